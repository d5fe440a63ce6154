"""`build_app`: pdserve as a Ray Serve application (`serve run` / `serve deploy` with
`import_path: services.ray_serve:build_app`; deploy/ray_serve/*.yaml).

Four deployments: `router` (the ingress), `prefill`, `decode` and `registry`, each with the
Serve options its `*_config.deployment_config` gives (`app_config.py`). The builder lives in
the `services` package, not in deploy/: Serve imports it on every node, and a pip-installed
package is importable there while a checkout's folder would need a runtime_env upload.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from ray.serve import Application

from services.cluster.prometheus_targets import check_path
from services.engine.loader import check_model
from services.ray_serve.app_config import PoolSpec, RayAppConfig, parse_args
from services.ray_serve.autoscaling import POLICY
from services.ray_serve.registry import Registry
from services.ray_serve.router import RouterReplica
from services.ray_serve.worker_deployments import DecodeReplica, PrefillReplica


def build_app(args: Mapping[str, Any] | None = None) -> Application:
    """The bound application for Serve's `args` (ValueError naming a bad argument)."""
    app = parse_args(args)
    check_paths(app)
    # serve.deployment's classes (typed as the plain classes) carry .options / .bind.
    registry = cast(Any, Registry).options(**options(app.registry)).bind(app)
    decode = cast(Any, DecodeReplica).options(**options(app.decode, worker=True))
    workers = [decode.bind(app, registry)]
    if app.prefill is not None:
        prefill = cast(Any, PrefillReplica).options(**options(app.prefill, worker=True))
        workers.insert(0, prefill.bind(app, registry))
    return cast(Any, RouterReplica).options(**options(app.router)).bind(app, registry, *workers)


def check_paths(app: RayAppConfig) -> None:
    """What `build_app` checks on the node that builds the application (where `serve deploy`
    sends its config, the head): the model is a known name or a model folder there (every node
    needs it), and the targets file's folder exists and is writable. A failure here refuses the
    deploy and the running version keeps serving; found in a replica's constructor instead, it
    would take the application down until the next deploy. ValueError naming the field."""
    try:
        check_model(app.cluster.engine.model)
    except ValueError as exc:
        raise ValueError(f"engine.{exc}") from None
    if app.cluster.prometheus_targets:
        check_path(app.cluster.prometheus_targets)


def options(spec: PoolSpec, worker: bool = False) -> dict[str, Any]:
    """Serve options of a deployment: its `deployment_config`, with the engine-load policy
    named in a worker pool's `autoscaling_config` that names none (`autoscaling.py`)."""
    result = dict(spec.deployment_config)
    autoscaling = result.get("autoscaling_config")
    if worker and isinstance(autoscaling, Mapping) and "policy" not in autoscaling:
        result["autoscaling_config"] = {**autoscaling, "policy": {"policy_function": POLICY}}
    return result


__all__ = ["RayAppConfig", "build_app"]
