"""The router process: the public `Generation` gRPC service (+ optional OpenAI HTTP API).

`serve(args)` starts it, prints one `ready {json}` line once requests are accepted, and blocks
until SIGINT/SIGTERM. `start_router(args)` does the same without printing or blocking (tests).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from services.common.pb import generate_pb2, generate_pb2_grpc, worker_pb2_grpc
from services.common.server import RunningService, start_service, wait_for_termination
from services.router.admin import RouterAdminServicer
from services.router.cancel import CancelScope
from services.router.generate import DEFAULT_REQUEST_TIMEOUT_S, GenerateFlow
from services.router.http_api import HttpApi
from services.router.prompt import ModelInfo
from services.router.routing import Routing
from services.router.workers import WorkerPool

ROUTER_MAX_STREAMS = 1024  # concurrent Generate streams (one thread each)
SERVICE_NAME = "pdserve.v1.Generation"


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """`Generation.Generate` over `GenerateFlow`: the client's deadline (or the router's
    request_timeout when it set none) bounds every downstream call, and a client cancel
    cancels the in-flight downstream call at once."""

    def __init__(self, flow: GenerateFlow) -> None:
        self.flow = flow

    def Generate(  # noqa: N802 - gRPC method name
        self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[generate_pb2.GenerateResponse]:
        deadline = self.flow.deadline_for(context.time_remaining())
        scope = CancelScope()
        # Runs when the RPC ends for any reason: cancel, deadline, or normal completion (no-op).
        if not context.add_callback(scope.cancel):
            scope.cancel()  # the RPC is already over
        yield from self.flow.generate(request, deadline, scope)


@dataclass
class RunningRouter:
    """A started router: gRPC service, request flow, optional HTTP API."""

    service: RunningService
    flow: GenerateFlow
    http: HttpApi | None

    def ready_line(self) -> str:
        """`ready {json}` with role, grpc, metrics, pid (and http when served)."""
        return self.service.ready_line(**({"http": self.http.url} if self.http else {}))

    def close(self) -> None:
        """Stops the HTTP API and closes worker channels (the gRPC server is stopped by the caller)."""
        if self.http is not None:
            self.http.close()
        self.flow.pool.close()

    def stop(self, grace: float = 1.0) -> None:
        """Stops everything (tests)."""
        self.service.server.stop(grace).wait()
        self.close()


def build_flow(args: argparse.Namespace) -> GenerateFlow:
    """Model info, worker pool and flow from `args` (see `serve`). ValueError names a bad field."""
    model = ModelInfo.load(args.model, getattr(args, "max_model_len", None))
    pool = WorkerPool(args.prefill or [], args.decode or [])
    routing = Routing(
        pool,
        getattr(args, "routing", "kv"),
        getattr(args, "redis_url", None),
        getattr(args, "index_ttl", 10.0),
    )
    timeout = getattr(args, "request_timeout", None)
    return GenerateFlow(
        model, pool, DEFAULT_REQUEST_TIMEOUT_S if timeout is None else timeout, routing
    )


def start_router(args: argparse.Namespace) -> RunningRouter:
    """Starts the router described by `args` (see `serve`) and returns once it accepts requests.

    Raises ValueError for bad arguments, RuntimeError / OSError when a port cannot be bound.
    """
    flow = build_flow(args)
    flow.pool.start_health_checks()
    servicer = GenerationServicer(flow)
    service = start_service(
        "router",
        [
            (generate_pb2_grpc.add_GenerationServicer_to_server, servicer, SERVICE_NAME),
            (
                worker_pb2_grpc.add_AdminServicer_to_server,
                RouterAdminServicer(flow.pool),
                "pdserve.v1.Admin",
            ),
        ],
        args.host,
        args.port,
        args.metrics_port,
        max_workers=ROUTER_MAX_STREAMS,
    )
    http = None
    http_port = getattr(args, "http_port", None)
    if http_port is not None:
        try:
            http = HttpApi(flow, args.host, http_port, args.model)
        except OSError:
            service.server.stop(0)
            raise
    return RunningRouter(service, flow, http)


def serve(args: argparse.Namespace) -> None:
    """Runs the router until SIGINT/SIGTERM.

    `args`: model (str: folder or known name), host (str), port (int, 0 = free), metrics_port
    (int, 0 = free), prefill / decode (list of HOST:PORT), request_timeout (seconds for a client
    without a deadline; default 300), http_port (int, 0 = free, or None for no HTTP API), and
    optionally max_model_len (int or None: the model's positions).
    Prints exactly one line, `ready {json}`, to stdout once requests are accepted.
    """
    router = start_router(args)
    print(router.ready_line(), flush=True)
    wait_for_termination(router.service, on_stop=router.close)
