"""`pdserve serve`'s cluster: which services to start, with which configs and commands.

`cluster_spec` turns a `ClusterConfig` (and its placement plan) into the child processes of a
local cluster: `num_prefill` + `num_decode` workers, then a router pointed at their addresses.
`services/cluster/supervisor.py` starts them, watches them and restarts one that dies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.cluster.children import ChildSpec
from services.cluster.config import ClusterConfig
from services.cluster.placement import PlacementPlan, plan_placement, visible_gpus
from services.config.handoff import to_json
from services.config.roles import API_KEY_ENV
from services.engine.kernels import cache as kernel_cache
from services.router.pool.serving_path import ServingPaths
from services.worker.core_ledger import CoreLedger, worker_name
from services.worker.cpus import parse_cpu_list

READY_PREFIX = "ready "
logger = logging.getLogger("pdserve.serve")


# --- what to start -------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSpec:
    """The workers, and how to build the router's command from the workers' gRPC addresses."""

    workers: list[ChildSpec]
    router: Callable[[list[str], list[str]], ChildSpec]  # (prefill addrs, decode addrs) -> spec
    start_timeout: float = 120.0  # seconds for each stage (workers, router) to become ready
    stop_timeout: float = 10.0  # seconds between SIGTERM and SIGKILL
    plan_line: str = ""  # the placement, logged at start
    path_line: str = ""  # which prompts prefill where, logged at start
    prometheus_targets: str | None = None  # file_sd file once ready (emptied on a clean stop)
    model: str = ""  # the served model, the targets' `model` label
    core_ledger: str | None = None  # the workers' core ledger, created at start, removed at stop
    home_cpus: dict[str, list[int]] = field(default_factory=dict)  # its worker name -> CPUs
    cpu_kernels: bool = False  # CPU workers: build the C++ kernels before they start

    def build_kernels(self, say: Callable[[str], None]) -> None:
        """Before the first child starts: on the CPU, build the C++ kernels once if this
        environment has none (`engine/kernels/cache.py`), so no worker's start timeout counts
        a compile; saying so first. A build that fails leaves the workers their torch path."""
        if not self.cpu_kernels or kernel_cache.built():
            return
        where = kernel_cache.build_dir()
        say(f"compiling the CPU kernels once (a minute or two on 2 cores): {where}")
        if not kernel_cache.build():
            say("the CPU kernels did not build: the workers use the pure-torch path")

    def prepare(self, say: Callable[[str], None] | None = None) -> list[str]:
        """Before the first child starts: build the CPU kernels if needed (`build_kernels`,
        telling `say`), create the core ledger. Returns the lines to log (the placement, the
        serving paths, lending)."""
        if say is not None:
            self.build_kernels(say)
        lines = [line for line in (self.plan_line, self.path_line) if line]
        if self.core_ledger:
            lines.append(create_core_ledger(self.core_ledger, self.home_cpus))
        return lines

    def clean_up(self) -> None:
        """After the last child stopped: remove the core ledger."""
        if self.core_ledger:
            with contextlib.suppress(OSError):
                os.unlink(self.core_ledger)


def child_spec(
    name: str, role: str, config: Any, env: Mapping[str, str] | None = None
) -> ChildSpec:
    """`python -m services.cli.main ROLE --config-json ...`: the child gets its whole config. A
    router's API key goes through the environment, never the command line (`ps` shows argv)."""
    env = dict(env or {})
    key = getattr(config, "api_key", None)
    if key:
        env[API_KEY_ENV] = key
    shown = dataclasses.replace(config, api_key=None) if key else config
    argv = [sys.executable, "-m", "services.cli.main", role, "--config-json", to_json(shown)]
    return ChildSpec(name, role, argv, config, env)


def placement_plan(
    config: ClusterConfig, cpus: list[int] | None = None, environ: Mapping[str, str] = os.environ
) -> PlacementPlan | None:
    """The cluster's placement (None with `placement: none`): over `cpus` (default: the CPUs
    this process may use) and, for a CUDA engine, the visible GPUs. Raises ValueError when
    there are fewer GPUs than workers."""
    if config.placement == "none":
        return None
    gpus = visible_gpus(environ) if config.engine.device == "cuda" else []
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    return plan_placement(cpus, config.num_prefill, config.num_decode, gpus)


def cluster_spec(config: ClusterConfig, plan: PlacementPlan | None = None) -> ClusterSpec:
    """The `pdserve serve` cluster: `num_prefill` + `num_decode` workers, each with the config
    `config.prefill_config(i, plan)` / `config.decode_config(i, plan)` derives (and its GPU as
    CUDA_VISIBLE_DEVICES), then the router pointed at their addresses."""

    pools = (
        ("prefill", config.num_prefill, config.prefill_config, plan.prefill_gpus if plan else ()),
        ("decode", config.num_decode, config.decode_config, plan.decode_gpus if plan else ()),
    )
    ledger = core_ledger_path() if config.lends_cores(plan) else None
    homes: dict[str, list[int]] = {}
    workers = []
    for role, count, member, gpus in pools:
        for i in range(count):
            worker = member(i, plan)
            if ledger is not None:
                cpus = worker.cpus
                assert cpus is not None  # `lends_cores`: the plan placed every worker
                worker = dataclasses.replace(worker, core_ledger=ledger)
                homes[worker_name(worker.engine.engine_id)] = parse_cpu_list(cpus)
            env = {"CUDA_VISIBLE_DEVICES": str(gpus[i])} if gpus else {}
            workers.append(child_spec(f"{role}-{i}", role, worker, env))

    def router(prefill: list[str], decode: list[str]) -> ChildSpec:
        return child_spec("router", "router", config.router_config(prefill, decode, plan))

    rule = config.router
    paths = ServingPaths(rule.disaggregation, rule.max_local_prefill_tokens, rule.slo_ttft_ms)
    path_line = f"serving path: {paths.describe(ledger is not None)}"

    return ClusterSpec(
        workers,
        router,
        start_timeout=config.start_timeout,
        plan_line=plan.describe() if plan else "placement: none (every process unpinned)",
        path_line=path_line,
        prometheus_targets=config.prometheus_targets,
        model=config.engine.model,
        core_ledger=ledger,
        home_cpus=homes,
        cpu_kernels=config.engine.device == "cpu",
    )


def create_core_ledger(path: str, home_cpus: dict[str, list[int]]) -> str:
    """Write the workers' core ledger (each holding its own CPUs); returns the line to log."""
    CoreLedger.create(path, home_cpus).close()
    return (
        f"core lending: an idle worker lends its CPUs to the busy ones (ledger {path}; "
        "--no-core-lending turns it off)"
    )


def core_ledger_path() -> str:
    """A fresh file name for a cluster's core ledger: in /dev/shm (memory) where there is one."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"pdserve-cores-{uuid.uuid4().hex[:12]}")
