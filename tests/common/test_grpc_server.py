"""start_service's health: SERVING at once, or NOT_SERVING until `set_serving`; draining wins."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import start_service
from services.common.pb import worker_pb2_grpc

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
