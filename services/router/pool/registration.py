"""The router's registered workers: a lease table (`services/common/member_leases.py`) that its
worker pool follows.

Workers reach the table two ways: `Admin.RegisterWorker` (a worker started with
`--register-with`), and `follow(source)`, which renews every member a source lists (under Ray,
the registry deployment's members: `services/ray_serve/router.py`, which drops one the registry no
longer lists at once). A member that stops renewing lapses after the router's
`registration_ttl` and leaves the pool; health checks take a dead
worker out of routing long before that (`worker_pool.py`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from services.common.member_leases import WORKER_ROLES, Member, MemberTable
from services.router.pool.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


class RouterMembership:
    """Registered workers of one router, mirrored into `pool` (join: `pool.add`; leave or
    lapse: `pool.remove`). Leases are checked every `ttl_s / 4` seconds on a daemon thread
    from `start()` until `close()`. Thread-safe."""

    def __init__(self, pool: WorkerPool, ttl_s: float) -> None:
        self.table = MemberTable(
            ttl_s,
            on_join=lambda m: pool.add(m.role, m.address),
            on_leave=lambda m: pool.remove(m.role, m.address),
        )
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def ttl_s(self) -> float:
        return self.table.ttl_s

    def register(self, member: Member, leave: bool = False) -> float:
        """Join, renew or (with `leave`) leave; returns the ttl the member must renew within."""
        if leave:
            if self.table.leave(member.address):
                logger.info("%s worker %s left", member.role, member.address)
        else:
            self.table.register(member)
        return self.table.ttl_s

    def start(self) -> None:
        self._spawn(self._expire_loop, "membership-expiry")

    def follow(self, source: Callable[[], list[Member]], interval_s: float) -> None:
        """Renew every member `source()` returns, every `interval_s` seconds, on a daemon
        thread; a member it stops listing leaves at once (a failing source is logged once per
        outage; its members then lapse after the ttl)."""
        self._spawn(lambda: self._follow_loop(source, interval_s), "membership-follow")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _expire_loop(self) -> None:
        while not self._stop.wait(self.table.ttl_s / 4):
            self.table.expire()

    def _follow_loop(self, source: Callable[[], list[Member]], interval_s: float) -> None:
        failing, followed = False, set[str]()
        while True:
            try:
                listed = [m for m in source() if m.role in WORKER_ROLES]
                for member in listed:
                    self.table.register(member)
                # The source is the authority for what it listed: one it no longer lists has
                # left (or lapsed there) and leaves now, not a router ttl later.
                current = {m.address for m in listed}
                for address in followed - current:
                    if self.table.leave(address) is not None:
                        logger.info("worker %s left the membership source", address)
                followed = current
                if failing:
                    logger.info("the membership source answers again")
                failing = False
            except Exception as exc:  # noqa: BLE001 - any source error: members lapse
                if not failing:
                    logger.warning("cannot read the membership source: %s", exc)
                failing = True
            if self._stop.wait(interval_s):
                return

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5.0)
