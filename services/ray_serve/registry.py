"""The registry deployment: which pdserve replicas are alive, under leases.

Every worker and router replica registers here once it serves (its gRPC address, /metrics URL
and replica id) and renews every third of the ttl; each router replica reads `members()` twice a
second and mirrors the workers into its pool (`services/router/pool/registration.py`). A replica
that Ray replaces stops renewing and lapses; its successor registers under its own address. The
registry also hands out CPUs (`claim_cpus`) so pinned replicas on one node never share one, and
writes the Prometheus file_sd targets of every replica (`prometheus_targets`), so the shipped
dashboards find them. One replica; if Ray restarts it, the replicas re-register within a renewal
period, and routers keep their members for their own ttl meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time

from ray import serve

from services.cluster.prometheus_targets import check_path, target_groups, write_targets
from services.common.member_leases import Member, MemberTable
from services.ray_serve.app_config import RayAppConfig

logger = logging.getLogger(__name__)


@serve.deployment(name="registry", ray_actor_options={"num_cpus": 0})
class Registry:
    """Members, CPU claims and the targets file of one pdserve application."""

    def __init__(self, app: RayAppConfig) -> None:
        self._targets = app.cluster.prometheus_targets
        if self._targets:
            try:  # checked at build time; a folder gone since must not take the app down
                check_path(self._targets)
            except ValueError as exc:
                logger.error("%s: no Prometheus targets are written", exc)
                self._targets = None
        self._model = app.cluster.engine.model
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._claims: dict[str, tuple[str, list[int], float]] = {}  # name -> (node, cpus, when)
        self.table = MemberTable(app.membership_ttl, on_join=self._changed, on_leave=self._left)
        self._stop = threading.Event()
        threading.Thread(target=self._expire_loop, name="registry-expiry", daemon=True).start()
        self._changed(None)

    def register(self, member: Member, leave: bool = False) -> float:
        """Join, renew or leave; returns the ttl in seconds to renew within."""
        if leave:
            self.table.leave(member.address)
        else:
            self.table.register(member)
        return self.table.ttl_s

    def members(self) -> list[Member]:
        """Every live member (routers included), in the order they joined."""
        return self.table.members()

    def claim_cpus(self, node: str, name: str, count: int, allowed: list[int]) -> list[int]:
        """`count` CPUs of `allowed` (the replica's own affinity) that no other live claim on
        `node` holds, for replica `name` (again the same ones if it asks twice). When fewer are
        free the replica gets the least-claimed ones, shared, and a warning is logged."""
        with self._lock:
            if name in self._claims:
                return self._claims[name][1]
            held: dict[int, int] = {}
            for claim_node, cpus, _ in self._claims.values():
                if claim_node == node:
                    for cpu in cpus:
                        held[cpu] = held.get(cpu, 0) + 1
            ranked = sorted(allowed, key=lambda cpu: (held.get(cpu, 0), cpu))
            chosen = sorted(ranked[:count])
            if any(held.get(cpu, 0) for cpu in chosen):
                logger.warning(
                    "node %s has fewer free CPUs than replica %s asks for (%d): it shares %s",
                    node,
                    name,
                    count,
                    chosen,
                )
            self._claims[name] = (node, chosen, time.monotonic())
            return chosen

    def _left(self, member: Member) -> None:
        with self._lock:
            self._claims.pop(member.name, None)
        self._changed(member)

    def _changed(self, member: Member | None) -> None:
        self._dirty.set()

    def _expire_loop(self) -> None:
        while True:
            self.table.expire()
            self._drop_orphan_claims()
            if self._dirty.is_set():
                self._dirty.clear()
                self._write_targets()
            if self._stop.wait(min(1.0, self.table.ttl_s / 4)):
                return

    def _drop_orphan_claims(self) -> None:
        """A replica that died before it registered never leaves: its claim goes after 3 ttls."""
        names = {m.name for m in self.table.members()}
        cutoff = time.monotonic() - 3 * self.table.ttl_s
        with self._lock:
            for name in [n for n, (_, _, when) in self._claims.items() if when < cutoff]:
                if name not in names:
                    del self._claims[name]

    def _write_targets(self) -> None:
        if not self._targets:
            return
        services = [
            {"name": f"{m.role}-{m.name}", "grpc": m.address, "metrics": m.metrics_url}
            for m in self.table.members()
            if m.metrics_url
        ]
        try:
            write_targets(self._targets, target_groups(services, self._model))
        except OSError as exc:
            logger.warning("could not write the Prometheus targets: %s", exc)

    def __del__(self) -> None:
        self._stop.set()
