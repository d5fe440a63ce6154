"""When the router moves a stream to another decode worker (`RouterConfig.migration`).

Imports no torch: the CLI builds its flags from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check(name: str, value: object, minimum: float, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if not isinstance(value, kinds) or isinstance(value, bool) or not value >= minimum:
        kind = "an integer" if integer else "a number of seconds"
        raise ValueError(f"{name}: must be {kind} >= {minimum:g}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class MigrationConfig:
    """Request migration (`services/router/flow/migration.py`): a stream whose decode worker dies,
    or stalls while failing its health checks, continues on another decode worker."""

    max_migrations: int = 3
    """Times one request may move to another worker; past that it ends UNAVAILABLE naming
    the worker (0: never migrate)."""
    stream_stall_timeout: float = 10.0
    """Seconds a stream may go without a token while its worker fails its health checks
    before it is migrated (a healthy but slow worker keeps its streams)."""
    migration_wait: float = 30.0
    """Seconds a migrating request waits for a healthy decode worker (a restarted one counts)
    when none is left; then UNAVAILABLE."""

    def __post_init__(self) -> None:
        _check("max_migrations", self.max_migrations, 0, integer=True)
        _check("stream_stall_timeout", self.stream_stall_timeout, 0.1)
        _check("migration_wait", self.migration_wait, 0)
