"""Prometheus file-based service discovery for a `pdserve serve` cluster.

`pdserve serve --prometheus-targets FILE` writes FILE once the cluster is ready: one target group
per service, its /metrics address as the target and three labels the shipped dashboards and
alerts use (`deploy/prometheus/prometheus.yml` reads the file through `file_sd_configs`):
- `service`: the child's name (`router`, `prefill-0`, `decode-1`, ...);
- `worker`: its gRPC address, the value the router's `pdserve_worker_healthy{worker}` carries;
- `model`: the served model's name.
Every metric already carries `role`, so the target labels do not repeat it. The file is replaced
atomically (Prometheus watches it) and emptied when the cluster stops on SIGINT/SIGTERM, so its
targets leave; a cluster that ends because a child died leaves them, so Prometheus sees it down.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit


def model_label(model: str) -> str:
    """The `model` label of a `--model` value: a folder's last component, or the name."""
    return os.path.basename(model.rstrip("/")) or model


def target_groups(services: Iterable[Mapping[str, Any]], model: str) -> list[dict]:
    """file_sd groups for the ready line's `services` (each with name, grpc and metrics)."""
    groups = []
    for service in services:
        url = urlsplit(service["metrics"])
        groups.append(
            {
                "targets": [url.netloc],
                "labels": {
                    "service": service["name"],
                    "worker": service["grpc"],
                    "model": model_label(model),
                    "__metrics_path__": url.path or "/metrics",
                },
            }
        )
    return groups


def check_path(path: str) -> None:
    """Refuse a targets path that could not be written, before anything starts: ValueError
    naming `prometheus_targets` for a folder, a missing or unwritable parent folder, or a name
    Prometheus's `targets/*.json` glob would not read."""
    folder = os.path.dirname(os.path.abspath(path))
    problem = None
    if os.path.isdir(path):
        problem = "is a folder; name a file in it, e.g. targets/pdserve.json"
    elif not os.path.isdir(folder):
        problem = f"its folder {folder} does not exist"
    elif not os.access(folder, os.W_OK):
        problem = f"its folder {folder} is not writable"
    elif not path.endswith(".json"):
        problem = "must end in .json (prometheus.yml reads targets/*.json)"
    if problem:
        raise ValueError(f"prometheus_targets: {path} {problem}")


def write_targets(path: str, groups: list[dict]) -> None:
    """Replace `path` with `groups` as JSON in one rename (a reader never sees half a file; the
    temporary file's name does not match `*.json`, and it is removed if the rename fails).
    Raises OSError naming the path."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".targets-", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(groups, f, indent=2)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise OSError(f"prometheus_targets: cannot write {path} ({exc.strerror})") from None
