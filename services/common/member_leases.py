"""Runtime membership: which workers a router routes to when they come and go.

A worker joins by registering (role, gRPC address, /metrics URL) and stays a member while it
renews within a time to live; it leaves on a clean stop, and one that dies simply lapses. The
same lease table serves two paths: the router's `Admin.RegisterWorker` RPC (workers started with
`--register-with ROUTER`) and, under Ray, the registry deployment that every replica registers
with and every router replica reads (`services/ray_serve/registry.py`). Dynamo keeps workers in
etcd under leases the same way; a lapsed lease is the only removal a crashed worker needs.

`MemberTable` is the lease table, `Registrar` the worker-side thread that keeps one
registration alive over any transport. Imports no torch, grpc or ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

ROLES = ("router", "prefill", "decode")  # a router registers only for its /metrics target
WORKER_ROLES = ("prefill", "decode")  # what a router's pool holds
DEFAULT_TTL_S = 10.0
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """One registered worker. Raises ValueError naming a bad field."""

    role: str
    """"prefill", "decode" or "router"."""
    address: str
    """HOST:PORT of its gRPC server (what routers and peers dial; the member's key)."""
    metrics_url: str = ""
    """http://HOST:PORT/metrics, for Prometheus targets ("" when unknown)."""
    name: str = ""
    """Who it is to an operator (a Ray replica id; "" outside Ray)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {list(ROLES)}, got {self.role!r}")
        host, sep, port = self.address.rpartition(":")
        if not (host and sep and port.isdigit()):
            raise ValueError(f"address: expected HOST:PORT, got {self.address!r}")


class MemberTable:
    """Members under leases of `ttl_s` seconds (> 0). Thread-safe.

    `register` adds or renews and says whether the member is new; `leave` and `expire` remove;
    `on_join(member)` / `on_leave(member)` run (outside the lock) for every change, which is how
    the router's worker pool follows the table.
    """

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        on_join: Callable[[Member], None] | None = None,
        on_leave: Callable[[Member], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl: must be > 0 seconds, got {ttl_s!r}")
        self.ttl_s = ttl_s
        self._on_join = on_join
        self._on_leave = on_leave
        self._clock = clock
        self._lock = threading.Lock()
        self._members: dict[str, tuple[Member, float]] = {}  # address -> (member, expires at)

    def register(self, member: Member) -> bool:
        """Join or renew for `ttl_s` seconds from now; True when `member` is new. A known
        address registering under another role or name replaces its old entry."""
        with self._lock:
            old = self._members.get(member.address)
            self._members[member.address] = (member, self._clock() + self.ttl_s)
        if old is not None and old[0] == member:
            return False
        if old is not None and self._on_leave:
            self._on_leave(old[0])
        if self._on_join:
            self._on_join(member)
        return True

    def leave(self, address: str) -> Member | None:
        """Remove the member at `address` now (None when there was none)."""
        with self._lock:
            entry = self._members.pop(address, None)
        if entry is not None and self._on_leave:
            self._on_leave(entry[0])
        return entry[0] if entry else None

    def expire(self) -> list[Member]:
        """Remove every member whose lease has lapsed; returns them."""
        now = self._clock()
        with self._lock:
            lapsed = [m for m, expires in self._members.values() if expires <= now]
            for member in lapsed:
                del self._members[member.address]
        for member in lapsed:
            logger.warning(
                "worker %s (%s) stopped renewing: out of the pool", member.address, member.role
            )
            if self._on_leave:
                self._on_leave(member)
        return lapsed

    def members(self, role: str | None = None) -> list[Member]:
        """The live members (of `role`), in the order they joined."""
        with self._lock:
            return [m for m, _ in self._members.values() if role is None or m.role == role]


class Registrar:
    """Keeps one worker registered: `register(member, leave)` at start, again every
    `interval_s` seconds on a daemon thread (default: a third of the ttl the first call
    returns), and once with leave=True on `stop()`.

    `register` is the transport (a gRPC call to a router, a Ray registry call) and returns the
    ttl in seconds the other side granted. A failed renewal is logged and retried at the next
    interval (the first call's failure is raised to the caller of `start`, so a worker whose
    router is unreachable says so at start).
    """

    def __init__(
        self,
        member: Member,
        register: Callable[[Member, bool], float],
        interval_s: float | None = None,
        description: str = "router",
    ) -> None:
        self.member = member
        self._register = register
        self._interval_s = interval_s
        self._description = description
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Register now (raises what the transport raises), then keep renewing."""
        ttl = self._register(self.member, False)
        interval = self._interval_s or max(ttl / 3, 0.05)
        logger.info(
            "registered as %s worker %s with %s",
            self.member.role,
            self.member.address,
            self._description,
        )
        self._thread = threading.Thread(
            target=self._renew, args=(interval,), name="registrar", daemon=True
        )
        self._thread.start()

    def _renew(self, interval_s: float) -> None:
        failing = False
        while not self._stop.wait(interval_s):
            try:
                self._register(self.member, False)
            except Exception as exc:  # noqa: BLE001 - any transport error: retry next time
                if not failing:
                    logger.warning(
                        "could not renew the registration with %s: %s", self._description, exc
                    )
                failing = True
                continue
            if failing:
                logger.info("registration with %s renewed again", self._description)
            failing = False

    def stop(self, leave: bool = True) -> None:
        """Stop renewing and (with `leave`) deregister; a failed leave is logged (the lease
        lapses by itself)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if not leave:
            return
        try:
            self._register(self.member, True)
        except Exception as exc:  # noqa: BLE001 - the lease lapses anyway
            logger.warning(
                "could not leave %s (%s): the lease lapses by itself", self._description, exc
            )
