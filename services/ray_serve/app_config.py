"""The Ray application's arguments (the `args:` of a Serve config file) as validated configs.

The shape follows Ray Serve LLM's P/D builder (`build_pd_openai_app`: a `prefill_config` and a
`decode_config`, each with its own `deployment_config`), with pdserve's role configs inside:

    engine: {...}            # EngineConfig: every worker's engine, as for `pdserve serve`
    index: {...}             # PrefixIndexConfig: the Redis URL, shared by router and workers
    prometheus_targets: F    # file_sd targets of every replica, written by the registry
    router_config:   {router: {...RouterConfig...}, deployment_config: {...}}
    prefill_config:  {worker: {...PrefillConfig...}, deployment_config: {...}, pin_cpus: B}
    decode_config:   {worker: {...DecodeConfig...},  deployment_config: {...}, pin_cpus: B}
    registry_config: {deployment_config: {...}, ttl: SECONDS}

`deployment_config` is any Serve deployment option (`num_replicas` or `autoscaling_config`,
`ray_actor_options` with `num_cpus` / `num_gpus`, `health_check_period_s`, ...), checked by
Serve itself. The role configs go through `ClusterConfig`, so every rule of `pdserve serve`
holds here too (one engine for every worker, ports and hosts set per replica). Imports no ray.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.cluster.config import ClusterConfig
from services.common.member_leases import DEFAULT_TTL_S
from services.config.handoff import from_dict

# Where each ClusterConfig field sits in the Ray arguments (error messages name that path).
_CLUSTER_PATHS = {
    "engine": "engine",
    "index": "index",
    "prometheus_targets": "prometheus_targets",
    "router": "router_config.router",
    "prefill": "prefill_config.worker",
    "decode": "decode_config.worker",
}
_POOL_KEYS = ("worker", "deployment_config", "pin_cpus")
_SECTIONS = {
    "router_config": ("router", "deployment_config"),
    "prefill_config": _POOL_KEYS,
    "decode_config": _POOL_KEYS,
    "registry_config": ("deployment_config", "ttl"),
}


@dataclass(frozen=True)
class PoolSpec:
    """One Serve deployment of pdserve: its Serve options and, for worker pools, placement."""

    deployment_config: Mapping[str, Any] = field(default_factory=dict)
    """Serve deployment options, passed to `Deployment.options` as given."""
    pin_cpus: bool = False
    """Pin each replica to `threads` CPUs of its node that no other pdserve replica there holds
    (claimed through the registry), instead of leaving it unpinned."""

    def threads(self, configured: int | None, num_cpus: float) -> int:
        """torch threads per replica: the worker config's `threads`, else one per whole CPU
        Ray reserved for the replica (`num_cpus`; at least one)."""
        return configured or max(1, math.floor(num_cpus))


@dataclass(frozen=True, kw_only=True)
class RayAppConfig:
    """Everything `build_app` needs; `parse_args` builds it."""

    cluster: ClusterConfig
    """The role configs (engine, index, router, prefill and decode workers)."""
    router: PoolSpec
    prefill: PoolSpec | None
    """None: no prefill deployment (`router.disaggregation: never`, prefill_config: null)."""
    decode: PoolSpec
    registry: PoolSpec
    membership_ttl: float = DEFAULT_TTL_S
    """Seconds a replica stays registered without renewing (renewed every third of it)."""


def parse_args(args: Mapping[str, Any] | None) -> RayAppConfig:
    """The Serve config's `args` as a RayAppConfig. Raises ValueError naming the field by its
    path in the arguments ("prefill_config.worker.threads: ...")."""
    args = dict(args or {})
    if unknown := sorted(set(args) - {*_SECTIONS, "engine", "index", "prometheus_targets"}):
        raise ValueError(f"{unknown[0]}: not an argument of pdserve's Ray app")
    sections = {name: _section(args, name) for name in _SECTIONS}
    no_prefill = "prefill_config" in args and args["prefill_config"] is None
    cluster_data = {
        "engine": args.get("engine"),
        "index": args.get("index"),
        "prometheus_targets": args.get("prometheus_targets"),
        "router": sections["router_config"].get("router"),
        "prefill": sections["prefill_config"].get("worker"),
        "decode": sections["decode_config"].get("worker"),
    }
    data = {k: v for k, v in cluster_data.items() if v is not None}
    data["num_prefill"] = 0 if no_prefill else 1
    try:
        cluster = from_dict(ClusterConfig, data)
    except ValueError as exc:
        first = str(exc).partition(".")[0].split(":")[0]
        raise ValueError(
            f"{_CLUSTER_PATHS[first]}{str(exc)[len(first) :]}"
            if first in _CLUSTER_PATHS
            else str(exc)
        ) from None
    if cluster.prometheus_targets and not os.path.isabs(cluster.prometheus_targets):
        raise ValueError(
            "prometheus_targets: must be an absolute path (the registry replica writes it, from "
            f"a working folder of Ray's), got {cluster.prometheus_targets!r}"
        )
    ttl = sections["registry_config"].get("ttl", DEFAULT_TTL_S)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
        raise ValueError(f"registry_config.ttl: must be > 0 seconds, got {ttl!r}")
    return RayAppConfig(
        cluster=cluster,
        router=_pool(sections["router_config"], "router_config"),
        prefill=None if no_prefill else _pool(sections["prefill_config"], "prefill_config"),
        decode=_pool(sections["decode_config"], "decode_config"),
        registry=_pool(sections["registry_config"], "registry_config"),
        membership_ttl=float(ttl),
    )


def _section(args: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = args.get(name) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a mapping, got {value!r}")
    if unknown := sorted(set(value) - set(_SECTIONS[name])):
        raise ValueError(f"{name}.{unknown[0]}: not a field (expected {list(_SECTIONS[name])})")
    return value


def _pool(section: Mapping[str, Any], name: str) -> PoolSpec:
    options = section.get("deployment_config") or {}
    if not isinstance(options, dict):
        raise ValueError(f"{name}.deployment_config: expected a mapping, got {options!r}")
    pin = section.get("pin_cpus", False)
    if not isinstance(pin, bool):
        raise ValueError(f"{name}.pin_cpus: expected true or false, got {pin!r}")
    return PoolSpec(deployment_config=options, pin_cpus=pin)
