"""A thread pool that shrinks: threads that stay idle for `idle_timeout_s` exit.

A synchronous gRPC server holds one thread per streaming call for the call's whole life, and
`concurrent.futures.ThreadPoolExecutor` never lets a thread go: after a burst of 200 streams a
decode worker kept 216 threads for good (issue 15). This executor grows the same way (a new
thread only when no idle one is waiting, up to `max_workers`) and gives threads back once the
burst is over, so a process returns to its idle thread count within `idle_timeout_s`.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_counter = itertools.count()


class ElasticThreadPool(Executor):
    """`submit` runs `fn(*args, **kwargs)` on a pool thread; at most `max_workers` threads."""

    def __init__(
        self, max_workers: int, idle_timeout_s: float = 5.0, thread_name_prefix: str = "pool"
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers: must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.idle_timeout_s = idle_timeout_s
        self._prefix = thread_name_prefix
        self._work: queue.SimpleQueue[tuple[Future, Callable, tuple, dict] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._waiting = 0  # threads blocked on the queue
        self._queued = 0  # items put and not yet taken
        self._shutdown = False

    @property
    def num_threads(self) -> int:
        with self._lock:
            return len(self._threads)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit after shutdown")
            self._queued += 1
            self._work.put((future, fn, args, kwargs))
            if self._queued > self._waiting and len(self._threads) < self.max_workers:
                thread = threading.Thread(
                    target=self._worker, name=f"{self._prefix}_{next(_counter)}", daemon=True
                )
                self._threads.add(thread)
                thread.start()
        return future

    def _worker(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                self._waiting += 1
            try:
                item = self._work.get(timeout=self.idle_timeout_s)
            except queue.Empty:
                with self._lock:
                    self._waiting -= 1
                    if self._queued > self._waiting:  # work arrived as we timed out: stay
                        continue
                    self._threads.discard(me)
                    return
            with self._lock:
                self._waiting -= 1
                if item is not None:
                    self._queued -= 1
            if item is None:  # shutdown
                with self._lock:
                    self._threads.discard(me)
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the future's owner
                future.set_exception(exc)
            del item, future, fn, args, kwargs  # drop references while idle

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Threads finish the queued work, then exit (`wait`: join them)."""
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                thread.join()
