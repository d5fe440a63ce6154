"""Starting a pdserve gRPC service: one error interceptor, health, reflection, /metrics, ready
line."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import typing
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.channels import GRPC_OPTIONS, health_serving
from services.common.errors import ErrorInterceptor
from services.common.metrics import start_metrics_server
from services.common.thread_pool import ElasticThreadPool

# Servers also refuse a port another process already listens on (gRPC sets SO_REUSEPORT by
# default, which would let two clusters silently share one port and split its clients).
SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.so_reuseport", 0)]
# Calls a server runs or queues at once unless its config says (`max_concurrent_rpcs`); more fail
# at once with RESOURCE_EXHAUSTED instead of queueing for a thread without end. Far above what a
# cluster sends one server (the router's Generate streams are bounded by its admission, a decode
# worker's Decode streams by max_num_seqs plus those waiting for KV, a prefill worker's Prefill
# calls by the routers' admission, plus KV pulls, one OpenKVGroup per decode peer and health
# checks), so only a flood meets it.
DEFAULT_MAX_CONCURRENT_RPCS = 4096
_Health = health_pb2.HealthCheckResponse  # its SERVING / NOT_SERVING statuses


@dataclass
class RunningService:
    """A started gRPC server with its addresses."""

    role: str
    server: grpc.Server
    grpc_address: str  # HOST:PORT
    metrics_url: str  # http://HOST:PORT/metrics
    health: health.HealthServicer
    port: int  # the gRPC port bound (a free one when 0 was asked for)
    metrics_port: int  # the /metrics port bound
    service_names: tuple[str, ...] = ()  # the registered services, whose health `set_serving` sets

    def set_serving(self) -> None:
        """Health SERVING for "" and every registered service (a worker calls it once warmed
        up). A no-op once draining (`enter_graceful_shutdown`): it stays NOT_SERVING."""
        for name in ("", *self.service_names):
            self.health.set(name, _Health.SERVING)

    def ready_line(self, **extra) -> str:
        """`ready {json}`: what `pdserve serve` reads to learn where this service listens."""
        info = {
            "role": self.role,
            "grpc": self.grpc_address,
            "metrics": self.metrics_url,
            "pid": os.getpid(),
            **extra,
        }
        return "ready " + json.dumps(info)


def start_service(
    role: str,
    register: list[tuple[Callable, object, str]],
    host: str,
    port: int,
    metrics_port: int,
    max_workers: int = 64,
    serving: bool = True,
    new_request_ids: bool = False,
    max_concurrent_rpcs: int | None = None,
) -> RunningService:
    """Start a server with the given servicers:
    [(add_XServicer_to_server, servicer, full service name)].

    `max_workers` bounds the handler threads (a blocking streaming call holds one for its whole
    life; a non-blocking one, such as Health.Watch, none); threads idle for a few seconds exit
    (`thread_pool.py`), so a burst leaves none behind. `max_concurrent_rpcs` bounds the calls
    running or queued for a thread (None: `default_max_concurrent_rpcs(max_workers)`); grpc
    refuses one more at once with RESOURCE_EXHAUSTED. A non-blocking call counts only while its
    handler runs, not for its stream's life.
    `new_request_ids`: calls that bring no `x-request-id` get a fresh one (the router; see
    `ErrorInterceptor`). `serving`: health SERVING at once; False starts it NOT_SERVING for ""
    and every service (the server accepts calls, but routers send none) until
    `RunningService.set_serving()`.

    Raises OSError naming `port` or `metrics_port` when one cannot be bound.
    """
    server = grpc.server(
        # grpc runs handlers on any Executor; its type stub names ThreadPoolExecutor
        typing.cast(
            futures.ThreadPoolExecutor,
            ElasticThreadPool(max_workers, thread_name_prefix=f"{role}-rpc"),
        ),
        interceptors=[ErrorInterceptor(new_request_ids)],
        options=SERVER_OPTIONS,
        maximum_concurrent_rpcs=(
            default_max_concurrent_rpcs(max_workers)
            if max_concurrent_rpcs is None
            else max_concurrent_rpcs
        ),
    )
    for add, servicer, _ in register:
        add(servicer, server)
    service_names = tuple(name for _, _, name in register)
    health_servicer = _add_health(server, service_names, serving)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"port: cannot bind {host}:{port} (in use, or not a local address)")
    try:
        metrics_bound = start_metrics_server(host, metrics_port)
    except OSError as exc:
        server.stop(0)
        raise OSError(f"metrics_port: cannot bind {host}:{metrics_port} ({exc.strerror})") from None
    server.start()
    return RunningService(
        role,
        server,
        f"{host}:{bound}",
        f"http://{host}:{metrics_bound}/metrics",
        health_servicer,
        bound,
        metrics_bound,
        service_names,
    )


def default_max_concurrent_rpcs(max_workers: int) -> int:
    """The bound on a server's concurrent calls when its config sets none: the default, or room
    for twice its handler threads where that is more (a decode worker with a huge max_num_seqs
    must not refuse its own batch's streams)."""
    return max(DEFAULT_MAX_CONCURRENT_RPCS, 2 * max_workers)


def _add_health(
    server: grpc.Server, service_names: tuple[str, ...], serving: bool
) -> health.HealthServicer:
    """The standard health service, SERVING or NOT_SERVING for "" and every service, and
    reflection of all of them."""
    # Non-blocking: each Watch stream is a callback the servicer calls on a status change, not a
    # server thread blocked until the client hangs up (the interceptor keeps it so).
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    status = _Health.SERVING if serving else _Health.NOT_SERVING
    for name in ("", *service_names):
        health_servicer.set(name, status)
    reflection.enable_server_reflection(
        [health.SERVICE_NAME, reflection.SERVICE_NAME, *service_names], server
    )
    return health_servicer


def is_serving(service: RunningService, timeout_s: float = 2.0) -> bool:
    """Whether the service answers its own gRPC health check with SERVING (over loopback to
    its address: a wedged server fails it too)."""
    with grpc.insecure_channel(service.grpc_address) as channel:
        return health_serving(channel, timeout_s)


def wait_for_termination(
    service: RunningService,
    on_stop: Callable[[], None] | None = None,
    grace: float = 5.0,
    draining: threading.Event | None = None,
    drained: Callable[[], bool] | None = None,
    drain_timeout: float = 0.0,
    before_stop: Callable[[], object] | None = None,
) -> None:
    """Block until SIGINT/SIGTERM, then drain and stop.

    Draining: health turns NOT_SERVING (routers stop sending work), `draining` is set (servicers
    refuse new requests with UNAVAILABLE), and the server keeps serving what it has (streams,
    KV pulls) until `drained()` is true or `drain_timeout` seconds pass. Then `before_stop` runs
    (the router ends what is left with UNAVAILABLE), the server stops accepting, gives calls
    `grace` seconds, and runs `on_stop`."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    drain_and_stop(service, on_stop, grace, draining, drained, drain_timeout, before_stop)


def drain_and_stop(
    service: RunningService,
    on_stop: Callable[[], None] | None = None,
    grace: float = 5.0,
    draining: threading.Event | None = None,
    drained: Callable[[], bool] | None = None,
    drain_timeout: float = 0.0,
    before_stop: Callable[[], object] | None = None,
) -> None:
    """The stop half of `wait_for_termination` (also what a Ray replica runs when Serve
    stops it)."""
    if draining is not None:
        draining.set()
    service.health.enter_graceful_shutdown()
    deadline = time.monotonic() + drain_timeout
    while drained is not None and time.monotonic() < deadline and not drained():
        time.sleep(0.1)
    if before_stop is not None:
        before_stop()
    service.server.stop(grace).wait()
    if on_stop is not None:
        on_stop()
    logging.getLogger(__name__).info("%s stopped", service.role)
