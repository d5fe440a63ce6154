"""The OpenAI-compatible HTTP server's limits and timeouts (`RouterConfig.http`).

Imports no torch and no HTTP library: the CLI builds its flags from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def _positive(name: str, value: object, minimum: float = 0.0) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > minimum
    if not ok:
        raise ValueError(f"{name}: must be a number > {minimum:g}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class HttpConfig:
    """Limits of the HTTP API (uvicorn under the hood: `services/router/openai/http_server.py`)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest request body in bytes; a larger one is refused (413) before it is read."""
    read_timeout: float = 30.0
    """Seconds a client may take to send one request's headers and body; a slower or stalled
    connection gets 408 and is closed."""
    keep_alive_timeout: float = 5.0
    """Seconds an idle keep-alive connection stays open between requests."""
    shutdown_timeout: float = 30.0
    """On SIGTERM: seconds running requests and streams get to finish before they are cut."""

    def __post_init__(self) -> None:
        if not (
            isinstance(self.max_body_bytes, int)
            and not isinstance(self.max_body_bytes, bool)
            and self.max_body_bytes >= 1
        ):
            raise ValueError(
                f"max_body_bytes: must be an integer >= 1, got {self.max_body_bytes!r}"
            )
        _positive("read_timeout", self.read_timeout)
        _positive("keep_alive_timeout", self.keep_alive_timeout)
        _positive("shutdown_timeout", self.shutdown_timeout, minimum=-1e-9)
