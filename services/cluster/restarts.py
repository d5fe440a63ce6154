"""How `pdserve serve` restarts a child that dies: when, on which ports, and when to give up.

A child that exits while the cluster serves is started again with the same config on the ports
it had bound (so the router's pool, the Prometheus targets and clients keep their addresses),
after a backoff that doubles with each crash in a row (1 s, 2 s, 4 s, ... at most 30 s; a child
that stayed up `STABLE_AFTER_S` seconds starts again from 1 s). A child that dies
`MAX_START_FAILURES` times in a row before it is ready (a bad model path, a port taken by
someone else) is not restarted again: the supervisor stops the cluster and exits 1. Kubernetes'
CrashLoopBackOff and systemd's `Restart=on-failure` with `StartLimitBurst` follow the same
pattern.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 30.0
MAX_START_FAILURES = 5


@dataclass
class _History:
    crashes: int = 0  # in a row, reset by a stable run
    start_failures: int = 0  # deaths before ready, in a row


class RestartPolicy:
    """Per child name: the delay before its next start, or None to give up."""

    def __init__(
        self,
        max_start_failures: int = MAX_START_FAILURES,
        initial_s: float = BACKOFF_INITIAL_S,
        max_s: float = BACKOFF_MAX_S,
        stable_after_s: float = STABLE_AFTER_S,
    ) -> None:
        self.max_start_failures = max_start_failures
        self.initial_s, self.max_s, self.stable_after_s = initial_s, max_s, stable_after_s
        self._history: dict[str, _History] = {}

    def on_exit(self, name: str, ready_for: float | None) -> float | None:
        """`name` exited after being ready for `ready_for` seconds (None: before it was ready).
        Returns the seconds to wait before starting it again, or None to give up."""
        history = self._history.setdefault(name, _History())
        if ready_for is None:
            history.start_failures += 1
            if history.start_failures >= self.max_start_failures:
                return None
        else:
            history.start_failures = 0
            if ready_for >= self.stable_after_s:
                history.crashes = 0
        history.crashes += 1
        return min(self.max_s, self.initial_s * 2 ** (history.crashes - 1))

    def start_failures(self, name: str) -> int:
        return self._history.get(name, _History()).start_failures


def bound_ports(config: object, ready: dict) -> object:
    """`config` (a role config) with the ports its process bound (its ready line) in place of
    0 = any: a restarted process listens where the old one did."""
    changes = {"port": _port(ready["grpc"]), "metrics_port": _port(ready["metrics"])}
    if ready.get("http") and hasattr(config, "http_port"):
        changes["http_port"] = _port(ready["http"])
    return dataclasses.replace(config, **changes)  # type: ignore[type-var]


def new_engine_identity(config: object) -> object:
    """A worker config (one with an `engine`) under a fresh engine_id, same role and index: a
    restarted process is another engine, with an empty cache and new KV segments, and its peers
    must see it as such (a decode worker keyed by the old id would keep reading the dead
    worker's shared-memory mapping). Other configs come back unchanged."""
    engine = getattr(config, "engine", None)
    if engine is None:
        return config
    stem, _, tail = engine.engine_id.rpartition("-")
    stem = stem if stem and len(tail) == 12 else engine.engine_id
    engine = dataclasses.replace(engine, engine_id=f"{stem}-{uuid.uuid4().hex[:12]}")
    return dataclasses.replace(config, engine=engine)  # type: ignore[type-var]


def _port(address: str) -> int:
    """The port of HOST:PORT or of a URL."""
    if "//" in address:
        port = urlsplit(address).port
        assert port is not None, address
        return port
    return int(address.rsplit(":", 1)[1])
