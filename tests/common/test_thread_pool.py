"""The shrinking thread pool under the gRPC servers and the HTTP flows: it grows to the work in
flight (never past max_workers), queues the rest, and gives idle threads back."""

from __future__ import annotations

import threading
import time

import pytest

from services.common.thread_pool import ElasticThreadPool


def _wait(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_grows_to_the_work_queues_past_the_bound_and_shrinks_when_idle():
    pool = ElasticThreadPool(8, idle_timeout_s=0.3)
    gate, started = threading.Event(), threading.Semaphore(0)

    def blocked(i: int) -> int:
        started.release()
        gate.wait()
        return i

    futures = [pool.submit(blocked, i) for i in range(12)]
    for _ in range(8):
        assert started.acquire(timeout=5)
    assert pool.num_threads == 8 and not started.acquire(timeout=0.2)  # 4 wait for a thread
    gate.set()
    assert [f.result(timeout=5) for f in futures] == list(range(12))
    assert _wait(lambda: pool.num_threads == 0), pool.num_threads  # all idle: all gone
    assert pool.submit(lambda: 7).result(timeout=5) == 7  # and it grows again
    pool.shutdown()


def test_an_idle_thread_is_reused_not_joined_by_a_new_one():
    pool = ElasticThreadPool(8, idle_timeout_s=5.0)
    for i in range(50):
        assert pool.submit(lambda i=i: i * 2).result(timeout=5) == i * 2
    assert pool.num_threads == 1
    pool.shutdown()
    assert pool.num_threads == 0


def test_errors_reach_the_future_and_shutdown_refuses_more():
    pool = ElasticThreadPool(2)
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=5)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)
    with pytest.raises(ValueError, match="max_workers"):
        ElasticThreadPool(0)
