"""The router deployment: the application's ingress, serving pdserve's own APIs.

Each replica runs the router as `pdserve router` does: the public gRPC `Generate` API on
`router.port` and the OpenAI HTTP API on `router.http_port`, bound to `router.host` on its node
(README, "Deploy on Ray": why these servers and not Serve's proxies). Its worker pool starts
empty and follows the registry: twice a second it renews every worker the registry lists, so
replicas that Ray adds or replaces join, and those gone lapse after `registration_ttl`; health
checks and KV-aware routing then work exactly as outside Ray. The prefill and decode handles it
is bound with are what put those deployments into the application; requests reach them over
gRPC. At most one replica per node (the ports are fixed).
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve

from services.common.member_leases import Member
from services.ray_serve.app_config import RayAppConfig
from services.ray_serve.handles import call

FOLLOW_INTERVAL_S = 0.5
logger = logging.getLogger(__name__)


@serve.deployment(name="router", ray_actor_options={"num_cpus": 1}, max_replicas_per_node=1)
class RouterReplica:
    """One pdserve router inside a Serve replica."""

    def __init__(self, app: RayAppConfig, registry: Any, *workers: Any) -> None:
        from services.common.logs import configure, default_format
        from services.router.server import start_router

        configure(default_format(), "router")
        config = app.cluster.router_config(prefill=[], decode=[])
        self.router = start_router(config, dynamic=True)
        self.router.membership.follow(
            lambda: call(registry, "members", timeout_s=5.0), FOLLOW_INTERVAL_S
        )
        name = serve.get_replica_context().replica_id.unique_id
        service = self.router.service
        member = Member("router", service.grpc_address, service.metrics_url, name)
        self._registrar_stop = _register(member, registry)
        logger.info(
            "router replica %s serves gRPC on %s%s",
            name,
            service.grpc_address,
            f", HTTP on {self.router.http.url}" if self.router.http else "",
        )

    def check_health(self) -> None:
        """Serve's health check: raises when the router's gRPC server stops answering."""
        from services.common.grpc_server import is_serving

        if not is_serving(self.router.service):
            raise RuntimeError("the router's gRPC health is not SERVING")

    def address(self) -> dict[str, Any]:
        """Where this replica serves: grpc, http, metrics (operators and tests)."""
        service = self.router.service
        http = self.router.http.url if self.router.http else None
        return {"grpc": service.grpc_address, "http": http, "metrics": service.metrics_url}

    def __del__(self) -> None:
        router = getattr(self, "router", None)
        if router is not None:
            self._registrar_stop()
            router.stop(grace=1.0)


def _register(member: Member, registry: Any) -> Any:
    """Keep the router registered (for its /metrics target); returns the stop function."""
    from services.common.member_leases import Registrar

    registrar = Registrar(
        member,
        lambda m, leave: call(registry, "register", m, leave),
        description="the Ray registry",
    )
    registrar.start()
    return registrar.stop
