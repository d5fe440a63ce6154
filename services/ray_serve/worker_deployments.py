"""The prefill and decode deployments: each replica is one pdserve worker.

A replica builds its worker config from the application's role configs (`ClusterConfig`, the
same derivation `pdserve serve` uses), binds its node's IP address on free ports (so peers on
other nodes can pull KV from it), places itself (torch threads from the config or its Ray CPUs;
with `pin_cpus`, CPUs of its own claimed through the registry; on a GPU node Ray's
CUDA_VISIBLE_DEVICES gives it its GPU), starts the worker in-process, and registers with the
registry. Requests reach it over pdserve's own gRPC, from the router, not through Serve.

Serve's health check calls `check_health` (a worker whose engine thread died, or whose gRPC
health stopped saying SERVING, is replaced); `record_autoscaling_stats` reports the engine's
running + waiting requests to the autoscaling policy (`autoscaling.py`); when Serve stops a
replica (scale-down, redeploy) it drains as on SIGTERM, then leaves the registry.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import ray
from ray import serve

from services.common.member_leases import Member
from services.ray_serve.app_config import PoolSpec, RayAppConfig
from services.ray_serve.handles import call
from services.worker.cpus import apply_cpu_placement, format_cpus

logger = logging.getLogger(__name__)


class WorkerReplica:
    """One pdserve worker of role `ROLE` inside a Serve replica."""

    ROLE = ""

    def __init__(self, app: RayAppConfig, registry: Any) -> None:
        from services.common.logs import configure, default_format
        from services.worker.runtime import RunningWorker

        configure(default_format(), self.ROLE)
        name = serve.get_replica_context().replica_id.unique_id
        spec = app.prefill if self.ROLE == "prefill" else app.decode
        assert spec is not None, "no prefill deployment is built without a prefill_config"
        config = self._config(app, spec, name, registry)
        config = dataclasses.replace(
            config, threads=apply_cpu_placement(config.threads, config.cpus)
        )
        self.worker: RunningWorker = self._start(config)
        self.drain_timeout = config.drain_timeout
        service = self.worker.service
        member = Member(self.ROLE, service.grpc_address, service.metrics_url, name)
        self.worker.join(
            member, lambda m, leave: call(registry, "register", m, leave), "the Ray registry"
        )
        logger.info(
            "%s replica %s serves on %s (threads %s, cpus %s)",
            self.ROLE,
            name,
            service.grpc_address,
            config.threads,
            config.cpus or "not pinned",
        )

    def _config(self, app: RayAppConfig, spec: PoolSpec, name: str, registry: Any) -> Any:
        """This replica's worker config: the pool's, on this node's IP, under its own engine
        id, with its threads and (pinned) CPUs."""
        cluster = app.cluster
        base = cluster.prefill_config(0) if self.ROLE == "prefill" else cluster.decode_config(0)
        assigned = ray.get_runtime_context().get_assigned_resources()
        if base.engine.device.startswith("cuda") and not assigned.get("GPU"):
            raise ValueError(
                f"engine.device: {base.engine.device!r}, but this {self.ROLE} replica has no "
                "GPU: give its deployment ray_actor_options.num_gpus: 1"
            )
        threads = spec.threads(base.threads, assigned.get("CPU", 1.0))
        cpus = base.cpus
        if spec.pin_cpus and cpus is None:
            node = ray.get_runtime_context().get_node_id()
            allowed = sorted(os.sched_getaffinity(0))
            cpus = format_cpus(call(registry, "claim_cpus", node, name, threads, allowed))
        engine = dataclasses.replace(base.engine, engine_id=f"{self.ROLE}-{name}")
        return dataclasses.replace(
            base, engine=engine, host=ray.util.get_node_ip_address(), threads=threads, cpus=cpus
        )

    def _start(self, config: Any) -> Any:
        raise NotImplementedError

    def check_health(self) -> None:
        """Serve's health check: raises (the replica is replaced) when the engine thread has
        died or the worker's gRPC health no longer says SERVING."""
        from services.common.grpc_server import is_serving

        if not self.worker.loop.alive:
            raise RuntimeError(f"{self.ROLE} engine thread is not running")
        if not is_serving(self.worker.service):
            raise RuntimeError(f"{self.ROLE} worker's gRPC health is not SERVING")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Requests on this engine (running + waiting), for `autoscaling.engine_load_policy`."""
        engine = self.worker.loop.engine
        return {"num_requests": float(engine.scheduler.num_running + engine.num_waiting)}

    def address(self) -> dict[str, Any]:
        """Where this replica serves: grpc, metrics, pid (operators and tests)."""
        service = self.worker.service
        return {"grpc": service.grpc_address, "metrics": service.metrics_url, "pid": os.getpid()}

    def __del__(self) -> None:
        """Serve stops the replica: drain as on SIGTERM, leave the registry, close."""
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.drain_and_stop(self.drain_timeout)


@serve.deployment(name="prefill", ray_actor_options={"num_cpus": 1, "num_gpus": 0})
class PrefillReplica(WorkerReplica):
    """A prefill worker (`services/prefill/server.py`)."""

    ROLE = "prefill"

    def _start(self, config: Any) -> Any:
        from services.prefill.server import start_prefill

        return start_prefill(config)


@serve.deployment(name="decode", ray_actor_options={"num_cpus": 1, "num_gpus": 0})
class DecodeReplica(WorkerReplica):
    """A decode worker (`services/decode/server.py`)."""

    ROLE = "decode"

    def _start(self, config: Any) -> Any:
        from services.decode.server import start_decode

        return start_decode(config)
