"""Runs an `Engine` on its own thread for a worker process.

The engine is single-threaded by design; RPC threads talk to it only through `EngineLoop`: they
submit and abort under one lock, and read per-request output queues. The loop thread steps the
engine whenever it has work, publishes worker metrics after every step, and runs `on_idle` hooks
(lease expiry) between steps.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from services.common import metrics
from services.engine import Engine, SamplingParams
from services.engine.kv_transfer.base import KVHandle
from services.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05  # how often an idle loop runs its hooks


class EngineLoop:
    """Owns the engine thread; every engine access from other threads goes through `lock`."""

    def __init__(self, engine: Engine, role: str) -> None:
        self.engine = engine
        self.role = role
        self.lock = threading.RLock()
        self._work = threading.Condition(self.lock)
        self._streams: dict[str, queue.Queue[RequestOutput | BaseException]] = {}
        self._hooks: list[Callable[[], None]] = []
        self._stopped = False
        self.max_step_tokens_per_request = 0
        self._last_preemptions = 0
        self._thread = threading.Thread(target=self._run, name=f"{role}-engine", daemon=True)

    def start(self) -> None:
        self._publish_metrics()
        self._thread.start()

    def stop(self) -> None:
        with self.lock:
            self._stopped = True
            self._work.notify_all()
        self._thread.join(timeout=10)

    def add_idle_hook(self, hook: Callable[[], None]) -> None:
        """`hook()` runs on the loop thread, under the lock, between steps."""
        self._hooks.append(hook)

    def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, kv_handle: KVHandle | None = None
    ) -> queue.Queue[RequestOutput | BaseException]:
        """Add a request; its outputs (or an exception) arrive on the returned queue.

        Raises the engine's InvalidRequestError / ResourceExhaustedError synchronously.
        """
        stream: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        with self.lock:
            self.engine.add_request(prompt_ids, params, request_id=request_id, kv_handle=kv_handle)
            self._streams[request_id] = stream
            self._work.notify_all()
        metrics.PROMPT_TOKENS.labels(self.role).inc(len(prompt_ids))
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort a running, waiting or pinned request; False if the engine no longer has it."""
        with self.lock:
            self._streams.pop(request_id, None)
            if request_id not in self.engine.requests and request_id not in self.engine.pinned:
                return False
            self.engine.abort(request_id)
            self._publish_metrics()
            return True

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self._stopped and not self.engine.has_unfinished_requests():
                    self._run_hooks()
                    self._work.wait(POLL_SECONDS)
                if self._stopped:
                    return
                self._step()
                self._run_hooks()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the step's requests, keep serving others
            logger.exception("engine step failed")
            self._fail_running(exc)
            return
        step_tokens = self.engine.last_forward_tokens.values()
        self.max_step_tokens_per_request = max([self.max_step_tokens_per_request, *step_tokens])
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)
            metrics.GENERATION_TOKENS.labels(self.role).inc(len(out.new_token_ids))
        self._publish_metrics()

    def _fail_running(self, exc: BaseException) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(exc)

    def _run_hooks(self) -> None:
        for hook in self._hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a hook must never kill the loop
                logger.exception("idle hook failed")

    def _publish_metrics(self) -> None:
        engine, role = self.engine, self.role
        pool = engine.kv_cache.pool
        metrics.KV_BLOCKS_FREE.labels(role).set(pool.num_free_blocks)
        metrics.KV_BLOCKS_PINNED.labels(role).set(sum(len(r.block_table) for r in engine.pinned.values()))
        metrics.KV_CACHE_USAGE.labels(role).set(pool.num_used_blocks / pool.num_blocks)
        metrics.NUM_REQUESTS_RUNNING.labels(role).set(engine.scheduler.num_running)
        metrics.NUM_REQUESTS_WAITING.labels(role).set(engine.scheduler.num_waiting)
        preemptions = engine.scheduler.num_preemptions
        metrics.NUM_PREEMPTIONS.labels(role).inc(preemptions - self._last_preemptions)
        self._last_preemptions = preemptions
