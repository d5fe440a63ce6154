"""`pdserve serve`'s config: a router and pools of prefill and decode workers on one machine,
and the config each child gets from it (`prefill_config(i)`, `decode_config(i)`,
`router_config(...)`). The role configs themselves are in `services/config/roles.py`."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import TypeVar

from services.cluster.placement import PlacementPlan
from services.config import checks
from services.config.roles import (
    DEFAULT_HTTP_PORT,
    DecodeConfig,
    PrefillConfig,
    PrefixIndexConfig,
    RouterConfig,
    WorkerConfig,
)
from services.engine.config import EngineConfig
from services.flags import flag
from services.kv_transfer.registry import KV_TRANSFER_BACKENDS
from services.worker.cpus import format_cpus

W = TypeVar("W", bound=WorkerConfig)
_WORKER_ONLY = ("role", "engine_id")  # set per worker, never a flag


_POOL = (
    "engine", "host", "port", "metrics_port", "register_with", "kv_transfer_backend",
    "core_ledger",
)  # fmt: skip
PLACEMENTS = ("auto", "none")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """`pdserve serve`: a router and pools of prefill and decode workers on this machine."""

    engine: EngineConfig = field(default_factory=EngineConfig, metadata=flag(exclude=_WORKER_ONLY))
    """The engine every worker runs (each in its own role, with its own engine_id)."""
    router: RouterConfig = field(
        default_factory=lambda: RouterConfig(http_port=DEFAULT_HTTP_PORT),
        metadata=flag(exclude=("model", "max_model_len", "prefill", "decode", "index", "cpus")),
    )
    """The router (its host binds the router alone: workers bind worker_host), its model and
    limits the engine's."""
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    """The prefix index, for the router and every worker."""
    prefill: PrefillConfig = field(
        default_factory=PrefillConfig,
        metadata=flag(prefix="prefill-", exclude=(*_POOL, "index", "drain_timeout")),
    )
    """Settings of each prefill worker (flags --prefill-*)."""
    decode: DecodeConfig = field(
        default_factory=DecodeConfig,
        metadata=flag(prefix="decode-", exclude=(*_POOL, "index", "drain_timeout")),
    )
    """Settings of each decode worker (flags --decode-*)."""
    worker_host: str = "127.0.0.1"
    """Address every prefill and decode worker binds (gRPC, KV transfer, admin, /metrics) and is
    reached at, whatever the router's --host: their ports have no API key, so they leave loopback
    only when this says so."""
    kv_transfer_backend: str = field(default="auto", metadata=flag(choices=KV_TRANSFER_BACKENDS))
    """How prompt KV moves from prefill to decode workers (`WorkerConfig.kv_transfer_backend`):
    "auto" takes shared memory here (one host), or one of grpc, shared_memory, torch_dist."""
    num_prefill: int = 1
    """Prefill workers (0 with --disaggregation never: the colocated mode)."""
    num_decode: int = 1
    """Decode workers."""
    start_timeout: float = 120.0
    """Seconds each service may take to become ready."""
    placement: str = field(default="auto", metadata=flag(choices=PLACEMENTS))
    """auto: give each worker CPUs of its own (and one GPU each on CUDA) and the router one CPU
    when there is one to spare, threads to match (`services/cluster/placement.py`; the plan is
    logged); none: leave every process unpinned with torch's default threads. A pool's --*-cpus or
    --*-threads wins over the plan."""
    core_lending: bool = True
    """With CPU placement (`placement: auto`, CPU engine, a CPU per worker): a worker with
    nothing to compute lends its CPUs to the node's busy workers, which widen their OpenMP teams
    onto them and give them back between steps when the owner has work again
    (`services/worker/core_lending.py`). Off with --disaggregation always (the fixed split)."""
    prometheus_targets: str | None = None
    """Write a Prometheus file_sd targets file here once the cluster is ready (every service's
    /metrics, with service, worker and model labels; emptied after a clean stop): what
    deploy/prometheus/prometheus.yml reads (`services/cluster/prometheus_targets.py`)."""

    def __post_init__(self) -> None:
        ok = isinstance(self.worker_host, str) and bool(self.worker_host)
        checks.check(ok, "worker_host", "must be a host name or address", self.worker_host)
        for name in ("num_prefill", "num_decode"):
            value = getattr(self, name)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            checks.check(ok, name, "must be an integer >= 0", value)
        checks.check(self.num_decode >= 1, "num_decode", "must be >= 1", self.num_decode)
        checks.check(
            self.num_prefill >= 1 or self.router.disaggregation == "never",
            "num_prefill",
            "must be >= 1 unless --disaggregation never (every prompt prefilled on its decode "
            "worker)",
            self.num_prefill,
        )
        checks.check(
            checks.is_number(self.start_timeout) and self.start_timeout > 0,
            "start_timeout",
            "must be > 0 seconds",
            self.start_timeout,
        )
        checks.check(
            self.placement in PLACEMENTS,
            "placement",
            f"expected one of {PLACEMENTS}",
            self.placement,
        )
        ok = isinstance(self.core_lending, bool)
        checks.check(ok, "core_lending", "must be true or false", self.core_lending)
        ok = self.kv_transfer_backend in KV_TRANSFER_BACKENDS
        checks.check(
            ok,
            "kv_transfer_backend",
            f"expected one of {KV_TRANSFER_BACKENDS}",
            self.kv_transfer_backend,
        )
        self._check_derived()

    def _check_derived(self) -> None:
        """The fields the cluster sets for each child must be left alone: a value given there
        would be silently replaced (raises ValueError naming it and where to set it)."""
        anonymous = dataclasses.replace(EngineConfig(), engine_id="-")
        for pool in ("prefill", "decode"):
            worker = getattr(self, pool)
            if dataclasses.replace(worker.engine, engine_id="-") != anonymous:
                raise ValueError(f"{pool}.engine: set by the cluster; set `engine` instead")
            for name in _POOL[1:]:
                if getattr(worker, name) != getattr(WorkerConfig, name):
                    raise ValueError(
                        f"{pool}.{name}: set by the cluster (worker_host, free ports, "
                        "kv_transfer_backend, core_lending)"
                    )
        for pool in ("prefill", "decode"):
            if getattr(self, pool).index != PrefixIndexConfig():
                raise ValueError(f"{pool}.index: set by the cluster; set `index` instead")
        defaults = RouterConfig()
        for name in ("model", "max_model_len", "prefill", "decode", "index", "cpus"):
            if getattr(self.router, name) != getattr(defaults, name):
                raise ValueError(
                    f"router.{name}: set by the cluster (from engine, index, the workers and "
                    "the placement)"
                )

    def prefill_config(self, index: int, plan: PlacementPlan | None = None) -> PrefillConfig:
        """The config of prefill worker `index` (free ports, its own engine id, the index, its
        CPUs from `plan` unless the pool names its own)."""
        worker = dataclasses.replace(self._member(self.prefill, index), index=self.index)
        return _placed(worker, plan.prefill[index] if plan else None)

    def decode_config(self, index: int, plan: PlacementPlan | None = None) -> DecodeConfig:
        """The config of decode worker `index` (free ports, its own engine id, its CPUs from
        `plan` unless the pool names its own)."""
        worker = dataclasses.replace(self._member(self.decode, index), index=self.index)
        return _placed(worker, plan.decode[index] if plan else None)

    def _member(self, worker: W, index: int) -> W:
        """Pool member `index`: the cluster's engine under a fresh engine id, on free ports of
        `worker_host` (the router reaches it at the address its ready line gives)."""
        engine_id = f"{worker.role.value}-{index}-{uuid.uuid4().hex[:12]}"
        engine = dataclasses.replace(self.engine, engine_id=engine_id)
        return dataclasses.replace(
            worker,
            engine=engine,
            host=self.worker_host,
            port=0,
            metrics_port=0,
            kv_transfer_backend=self.kv_transfer_backend,
        )

    def lends_cores(self, plan: PlacementPlan | None) -> bool:
        """Whether the workers of this cluster lend one another their CPUs (`core_lending`)."""
        return (
            self.core_lending
            and self.router.disaggregation != "always"
            and plan is not None
            and not plan.shared
            and not plan.prefill_gpus
            and not plan.decode_gpus
            and len(plan.prefill) + len(plan.decode) >= 2
            and self.prefill.cpus is None
            and self.decode.cpus is None
        )

    def router_config(
        self, prefill: list[str], decode: list[str], plan: PlacementPlan | None = None
    ) -> RouterConfig:
        """The router's config, pointed at the workers' gRPC addresses, on `plan`'s CPUs."""
        return dataclasses.replace(
            self.router,
            cpus=format_cpus(plan.router) if plan else None,
            model=self.engine.model,
            max_model_len=self.engine.max_model_len,
            index=self.index,
            prefill=tuple(prefill),
            decode=tuple(decode),
        )


def _placed(worker: W, cpus: tuple[int, ...] | None) -> W:
    """`worker` on `cpus` (threads follow: one per CPU), unless its pool named CPUs itself."""
    if cpus is None or worker.cpus is not None:
        return worker
    return dataclasses.replace(worker, cpus=format_cpus(cpus))
