"""The worker pool's health checks (services/router/pool/worker_pool.py) against real gRPC health
services on loopback."""

from __future__ import annotations

import time

from services.common.grpc_server import start_service
from services.router.pool.routing import Routing
from services.router.pool.worker_pool import WorkerPool


def test_health_checks_take_a_worker_out_and_bring_it_back():
    """A worker whose health service says NOT_SERVING (or that stops answering) for 2 checks
    gets no new requests; once it answers SERVING again it is back."""
    from grpc_health.v1 import health_pb2

    service = start_service("prefill", [], "127.0.0.1", 0, 0)
    other = start_service("prefill", [], "127.0.0.1", 0, 0)
    pool = WorkerPool([service.grpc_address, other.grpc_address], [])
    routing = Routing(pool, "round_robin")
    try:
        pool.start_health_checks(interval_s=0.05, timeout_s=0.5)

        def picks() -> set[str]:
            return {routing.pick_prefill([1])[0] for _ in range(4)}

        assert picks() == {service.grpc_address, other.grpc_address}
        service.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + 5
        while picks() != {other.grpc_address}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        service.health.set("", health_pb2.HealthCheckResponse.SERVING)
        while picks() != {service.grpc_address, other.grpc_address}:
            assert time.monotonic() < deadline + 5
            time.sleep(0.05)
        other.server.stop(0).wait()  # gone for good: taken out too
        while picks() != {service.grpc_address}:
            assert time.monotonic() < deadline + 10
            time.sleep(0.05)
    finally:
        pool.close()
        service.server.stop(0)
        other.server.stop(0)
