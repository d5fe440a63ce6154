"""Runs an `Engine` on its own thread for a worker process.

The engine is single-threaded by design. RPC threads never touch it directly: they hand the loop
a function with `call(fn)` and wait for its result. The loop thread runs queued calls before
every step (so adds, aborts, info and KV reads are served within one step time, however busy
the engine is: a shared lock would let the stepping thread starve them), steps the engine while
it has work, publishes worker metrics, and runs idle hooks (lease expiry). This is the input
queue of vLLM's EngineCore busy loop, in one process.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TypeVar

from services.common import metrics
from services.common.errors import ShuttingDownError
from services.cost_model.step_log import StepLog, StepRecord
from services.engine import Engine, SamplingParams
from services.engine import threads as omp
from services.engine.objectives import StreamObjectives
from services.engine.outputs import KVReserved, RequestOutput
from services.kv_transfer.handle import KVHandle
from services.worker.core_lending import CoreLending, NoLending
from services.worker.worker_metrics import COUNTERS, publish_worker_metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


POLL_SECONDS = 0.05  # how long an idle loop waits for a call before running its hooks again
CALL_TIMEOUT_S = 60.0
COMPUTE_THREAD_SUFFIX = "-step"  # named so while computing, with its team: /proc tells them apart


class EngineLoop:
    """Owns the engine thread; other threads reach the engine only through `call`."""

    def __init__(
        self,
        engine: Engine,
        role: str,
        step_log: str | None = None,
        threads: int | None = None,
        cpus: list[int] | None = None,
    ) -> None:
        """`step_log`: a file every step's shape and seconds are appended to (`--step-log`).
        `threads`: the engine thread's torch threads (None: torch's default); with `cpus` (the
        worker's `--cpus`) and no more threads than CPUs, thread i is pinned to cpus[i]
        (`pin_thread_team`). Raises OSError when the step log cannot be opened."""
        self.engine = engine
        self.role = role
        self.threads = threads
        self.cpus = cpus
        self.step_log = StepLog(step_log) if step_log else None
        self._calls: queue.Queue[tuple[Callable[[], object], Future] | None] = queue.Queue()
        self._streams: dict[str, queue.Queue[RequestOutput | KVReserved | BaseException]] = {}
        self._hooks: list[Callable[[], None]] = []
        self._stopped = False
        self.max_step_tokens_per_request = 0
        self._last_counts = dict.fromkeys(COUNTERS, 0)  # engine totals already exported
        self.lending: CoreLending | NoLending = NoLending()
        self._thread = threading.Thread(target=self._run, name=f"{role}-engine", daemon=True)

    def start(self) -> None:
        metrics.create_worker_series(self.role)
        self._publish_metrics()
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The engine thread runs (started, not stopped, not died)."""
        return self._thread.is_alive() and not self._stopped

    def stop(self) -> None:
        """Stop the thread; calls still queued (or made later) fail with ShuttingDownError."""
        self._stopped = True
        self._calls.put(None)
        self._thread.join(timeout=10)
        if self.step_log is not None and not self._thread.is_alive():
            self.step_log.close()
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[1].set_exception(ShuttingDownError("the worker is shutting down"))

    def start_lending(self, lending: CoreLending) -> None:
        """Lend this worker's CPUs while it is idle and borrow free ones while it is busy, from
        now on (after the warm-up: it computes on its own CPUs). Raises what `lending.start`
        raises."""

        def start() -> None:
            with self._computing():
                lending.start()
            self.lending = lending

        self.call(start)

    def add_idle_hook(self, hook: Callable[[], None]) -> None:
        """`hook()` runs on the loop thread between steps."""
        self._hooks.append(hook)

    def call(self, fn: Callable[[], T], timeout: float = CALL_TIMEOUT_S) -> T:
        """Run `fn()` on the loop thread and return its result (or raise its exception).

        Raises TimeoutError if the loop does not get to it within `timeout` seconds.
        """
        if threading.current_thread() is self._thread:
            return fn()
        if self._stopped:
            raise ShuttingDownError("the worker is shutting down")
        future: Future = Future()
        self._calls.put((fn, future))
        return future.result(timeout=timeout)

    def post(self, fn: Callable[[], object]) -> None:
        """Run `fn()` on the loop thread soon, without waiting for it (errors are logged)."""
        if self._stopped:
            raise ShuttingDownError("the worker is shutting down")
        future: Future = Future()

        def log_failure(f: Future) -> None:
            if f.exception():
                logger.error("posted call failed: %r", f.exception())

        future.add_done_callback(log_failure)
        self._calls.put((fn, future))

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        kv_handle: KVHandle | None = None,
        cache_salt: str | None = None,
        caller_active: Callable[[], bool] | None = None,
        output_token_ids: list[int] | None = None,
        objectives: StreamObjectives | None = None,
    ) -> queue.Queue[RequestOutput | KVReserved | BaseException]:
        """Add a request; its outputs (or an exception) arrive on the returned queue. A DECODE
        request first gets a `KVReserved` once its blocks are reserved: the receiver writes the
        pulled KV into them, then calls `kv_written` (and, as every caller, `abort` at its end).

        `caller_active` (the RPC's `context.is_active`) is asked on the loop thread as the add
        runs: a caller that left while the call waited for a step adds nothing (its stream stays
        empty), so a burst of cancels leaves no prompt behind to be prefilled for no one.
        `output_token_ids` (a migrated request's outputs), `objectives`: `Engine.add_request`.

        Raises the engine's InvalidRequestError / ResourceExhaustedError / KVHandshakeError
        synchronously.
        """
        stream: queue.Queue[RequestOutput | KVReserved | BaseException] = queue.Queue()

        def add() -> bool:
            if caller_active is not None and not caller_active():
                return False
            self.engine.add_request(
                prompt_ids,
                params,
                request_id=request_id,
                kv_handle=kv_handle,
                cache_salt=cache_salt,
                output_token_ids=output_token_ids,
                objectives=objectives,
            )
            self._streams[request_id] = stream
            return True

        if self.call(add):
            metrics.PROMPT_TOKENS.labels(self.role).inc(len(prompt_ids))
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort a running, waiting or pinned request; False if the engine no longer has it."""
        return self.call(lambda: self._abort(request_id))

    def abort_soon(self, request_id: str) -> None:
        """`abort` without waiting for the loop (an RPC whose caller left frees its thread)."""
        self.post(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> bool:
        self._streams.pop(request_id, None)
        if self.engine.kv_write_claimed(request_id):  # its receiver left before writing
            self.engine.kv_written(request_id, ok=False)
        if request_id not in self.engine.requests and request_id not in self.engine.pinned:
            return False
        self.engine.abort(request_id)
        return True

    def _computing(self) -> AbstractContextManager[None]:
        """The engine thread carries its compute name ("decode-step") meanwhile."""
        return omp.carrying_name(self.role + COMPUTE_THREAD_SUFFIX, f"{self.role}-engine")

    def _run(self) -> None:
        omp.name_python_threads()  # a thread a step starts (a gRPC channel's) does not compute
        with self._computing():  # the OpenMP team starts here and keeps the compute name
            if self.threads is not None and self.cpus and self.threads <= len(self.cpus):
                omp.pin_thread_team(self.cpus[: self.threads])
            elif self.threads is not None:
                omp.set_thread_threads(self.threads)
        try:
            while not self._stopped:
                busy = self.engine.has_unfinished_requests()
                if not busy:
                    self.lending.idle()
                self._run_calls(block=not busy)
                if self._stopped:
                    return
                self._deliver_reserved()
                if self.engine.has_unfinished_requests():
                    self.lending.reclaim()
                    with self._computing():
                        self.lending.before_step()
                        self._step()
                    self._deliver_reserved()
                self._run_hooks()
        finally:
            self.lending.close()

    def _deliver_reserved(self) -> None:
        # the RPC thread writes the KV
        for reserved in self.engine.take_reserved(claim_writes=True):
            stream = self._streams.get(reserved.request_id)
            if stream is not None:
                stream.put(reserved)
            else:  # its RPC already ended: nobody will write
                self.engine.kv_written(reserved.request_id, ok=False)

    def kv_written(self, request_id: str, ok: bool) -> None:
        """The receiver of a `KVReserved` is done writing (`ok`: all of it); does not wait."""
        self.post(lambda: self.engine.kv_written(request_id, ok))

    def _run_calls(self, block: bool) -> None:
        """Run every queued call; when `block`, first wait up to POLL_SECONDS for one."""
        try:
            item = self._calls.get(timeout=POLL_SECONDS) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed back to the calling thread
                    future.set_exception(exc)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the step's requests, keep serving others
            logger.exception("engine step failed")
            self._fail_running(exc)
            return
        seconds, step = time.perf_counter() - started, self.engine.last_step
        if self.step_log is not None and step is not None and step.scheduled:
            rows = tuple((len(s.token_ids), s.start_position) for s in step.scheduled)
            self.step_log.write(StepRecord(rows, seconds, self.engine.num_threads()))
        metrics.observe_step_budget(self.role, self.engine.scheduler.last_prefill_budget)
        step_tokens = self.engine.last_forward_tokens.values()
        self.max_step_tokens_per_request = max([self.max_step_tokens_per_request, *step_tokens])
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)
            metrics.GENERATION_TOKENS.labels(self.role).inc(len(out.new_token_ids))

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
        self._publish_metrics()

    def _publish_metrics(self) -> None:
        self._last_counts = publish_worker_metrics(self.engine, self.role, self._last_counts)
