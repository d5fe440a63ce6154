"""The field checks every config's `__post_init__` shares: each raises ValueError naming the
field, the rule and the value it got."""

from __future__ import annotations


def check(ok: bool, name: str, message: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}, got {value!r}")


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_listen(host: object, port: object, metrics_port: object) -> None:
    """Where a service listens: a host, a gRPC port and a /metrics port."""
    check(isinstance(host, str) and bool(host), "host", "must be a host name or address", host)
    check_port("port", port)
    check_port("metrics_port", metrics_port)


def check_max_concurrent_rpcs(value: object) -> None:
    if value is not None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        check(ok, "max_concurrent_rpcs", "must be an integer >= 1 or None", value)


def check_port(name: str, value: object) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 65536
    check(ok, name, "must be a port number in [0, 65536) (0 picks a free one)", value)
