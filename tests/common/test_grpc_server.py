"""start_service: health SERVING at once, or NOT_SERVING until `set_serving` (draining wins);
idle Health.Watch streams hold no thread; calls beyond the server's bound fail at once."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import (
    DEFAULT_MAX_CONCURRENT_RPCS,
    default_max_concurrent_rpcs,
    start_service,
)
from services.common.pb import common_pb2, worker_pb2, worker_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NAMES = ("", "pdserve.v1.Admin")


def health_status(address: str, service: str = "") -> int:
    """The health service's answer for `service` ("" = the whole server)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        return stub.Check(request, timeout=5).status


def _start(**kwargs):
    admin = (worker_pb2_grpc.add_AdminServicer_to_server, worker_pb2_grpc.AdminServicer(), NAMES[1])
    return start_service("prefill", [admin], "127.0.0.1", 0, 0, **kwargs)


def test_a_service_is_serving_at_once_by_default():
    service = _start()
    try:
        assert [health_status(service.grpc_address, n) for n in NAMES] == [SERVING, SERVING]
    finally:
        service.server.stop(0)


def test_a_service_started_not_serving_serves_after_set_serving_until_it_drains():
    service = _start(serving=False)
    try:
        assert service.service_names == ("pdserve.v1.Admin",)
        assert [health_status(service.grpc_address, n) for n in NAMES] == [NOT_SERVING] * 2
        service.set_serving()
        assert [health_status(service.grpc_address, n) for n in NAMES] == [SERVING] * 2
        service.health.enter_graceful_shutdown()  # SIGTERM: draining
        service.set_serving()  # e.g. a warm-up that ends after SIGTERM: draining wins
        assert [health_status(service.grpc_address, n) for n in NAMES] == [NOT_SERVING] * 2
    finally:
        service.server.stop(0)


class _Admin(worker_pb2_grpc.AdminServicer):
    def GetInfo(self, request, context):
        return common_pb2.WorkerInfo(role="prefill")


class _Decode(worker_pb2_grpc.DecodeServicer):
    """A Decode stream that sends one message, then holds its thread until `release`."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Decode(self, request, context):
        yield worker_pb2.DecodeResponse()
        self.release.wait(30)


def test_idle_watch_streams_hold_no_thread():
    """Many more open Health.Watch streams (no key needed) than handler threads leave unary
    calls answering at once (security review H4): Watch is non-blocking and the error
    interceptor keeps it so. With Watch on a thread each, Check and GetInfo would wait."""
    workers, num_watches = 4, 40
    admin = (worker_pb2_grpc.add_AdminServicer_to_server, _Admin(), NAMES[1])
    service = start_service("prefill", [admin], "127.0.0.1", 0, 0, max_workers=workers)
    channel = grpc.insecure_channel(service.grpc_address)
    health_stub = health_pb2_grpc.HealthStub(channel)
    watches = [
        health_stub.Watch(health_pb2.HealthCheckRequest(service=NAMES[i % 2]), timeout=60)
        for i in range(num_watches)
    ]
    reader = futures.ThreadPoolExecutor(num_watches)
    firsts = [reader.submit(next, watch) for watch in watches]
    try:
        # `workers` watches are being served: were they blocking, they would hold every thread.
        deadline = time.monotonic() + 10
        while sum(first.done() for first in firsts) < workers and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        check = health_stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
        info = worker_pb2_grpc.AdminStub(channel).GetInfo(common_pb2.InfoRequest(), timeout=3)
        assert (check.status, info.role) == (SERVING, "prefill")
        assert time.monotonic() - started < 2
        # ... and every watch is live: its first status, then the change.
        assert [first.result(timeout=10).status for first in firsts] == [SERVING] * num_watches
        service.health.enter_graceful_shutdown()
        assert [next(watch).status for watch in watches] == [NOT_SERVING] * num_watches
    finally:
        for watch in watches:
            watch.cancel()
        reader.shutdown()
        channel.close()
        service.server.stop(0)


def test_calls_beyond_the_bound_fail_at_once_with_resource_exhausted():
    decode = _Decode()
    register = [(worker_pb2_grpc.add_DecodeServicer_to_server, decode, "pdserve.v1.Decode")]
    service = start_service("decode", register, "127.0.0.1", 0, 0, max_concurrent_rpcs=3)
    channel = grpc.insecure_channel(service.grpc_address)
    stub, health_stub = worker_pb2_grpc.DecodeStub(channel), health_pb2_grpc.HealthStub(channel)
    streams = [stub.Decode(worker_pb2.DecodeRequest(), timeout=60) for _ in range(3)]
    try:
        for stream in streams:  # under the bound: all three run
            next(stream)
        for call in (
            lambda: list(stub.Decode(worker_pb2.DecodeRequest(), timeout=10)),
            lambda: health_stub.Check(health_pb2.HealthCheckRequest(), timeout=10),
        ):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - started < 2  # refused, not queued until its deadline
        decode.release.set()
        for stream in streams:
            assert list(stream) == []
        deadline = time.monotonic() + 5  # a finished call frees its slot just after it ends
        while True:
            try:
                check = health_stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert check.status == SERVING
    finally:
        decode.release.set()
        channel.close()
        service.server.stop(0)


def test_the_default_bound_leaves_room_for_every_thread():
    assert default_max_concurrent_rpcs(64) == DEFAULT_MAX_CONCURRENT_RPCS == 4096
    # a decode worker with max_num_seqs 5000 has 5064 threads: its streams are never refused
    assert default_max_concurrent_rpcs(5064) == 10128
    service = _start()
    try:
        assert service.server._state.maximum_concurrent_rpcs == 4096  # what grpc enforces
    finally:
        service.server.stop(0)
