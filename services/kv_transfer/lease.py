r"""The source side of a transfer: one lease per pinned request, and the table that holds them.

A PREFILL engine keeps a finished request's prompt blocks pinned until a destination confirms the
KV landed. Nothing may wait on that confirmation forever (the destination can die), so the pin is
held under a lease, as Mooncake and vLLM's NIXL connector do: the destination renews it while it
pulls or waits for blocks of its own, and the source frees the blocks when it lapses. Every
message may arrive late or twice; a transition that no longer applies returns False and does
nothing, so the blocks have exactly one path back to free.

A pull reads the pinned blocks in place (no copy), so a transfer cannot end while a pull is in
progress: a completion or revocation that arrives then is held, and the transfer ends (and the
caller frees the pin) when the last pull ends. A streaming source holds a pull only while it
reads each chunk, so a receiver that hangs mid-stream cannot hold the blocks past a lease.
Each transition returns True exactly when the caller must free the pin now.

    PUBLISHED --begin_pull--> PULLING --end_pull--> PUBLISHED
        |  \                     |
        |   +-------- complete --+--> COMPLETED  (the destination has the KV)
        +--- expire (lease lapsed, not while PULLING) --> EXPIRED
        +--- revoke (the source aborted it) ------------> REVOKED
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.engine.errors import RequestNotFoundError

DEFAULT_LEASE_S = 30.0
# Ended transfers are remembered this long, so that a late or duplicate message finds them (and
# does nothing) and a release that overtook its publish still applies; at most MAX_ENDED of them.
ENDED_TTL_S = 600.0
MAX_ENDED = 100_000


class TransferStatus(enum.Enum):
    """Where one request's transfer stands at its source."""

    PUBLISHED = "published"  # pinned, waiting for a pull; the lease runs
    PULLING = "pulling"  # at least one destination is reading the blocks; the lease cannot lapse
    COMPLETED = "completed"  # the destination confirmed the KV landed; pin released
    EXPIRED = "expired"  # nobody renewed the lease in time; pin released
    REVOKED = "revoked"  # the source aborted it (its client went away); pin released

    @property
    def is_ended(self) -> bool:
        return self in (TransferStatus.COMPLETED, TransferStatus.EXPIRED, TransferStatus.REVOKED)


@dataclass
class Lease:
    """One pinned request's transfer; one method per transition, each returns whether it applied.

    `expires_at` is a `clock()` time in seconds; `num_pulls` counts pulls in progress.
    """

    request_id: str
    lease_s: float
    expires_at: float
    status: TransferStatus = TransferStatus.PUBLISHED
    num_pulls: int = 0
    ending: TransferStatus | None = None  # an end that came during a pull, applied when it ends

    def begin_pull(self, now: float) -> None:
        """A destination starts reading. Raises RequestNotFoundError once the transfer ended
        (or is ending)."""
        if self.status.is_ended or self.ending is not None:
            status = self.ending or self.status
            raise RequestNotFoundError(f"KV of request {self.request_id!r} was {status.value}")
        self.num_pulls += 1
        self.status = TransferStatus.PULLING
        self.expires_at = now + self.lease_s

    def end_pull(self, now: float) -> bool:
        """A pull ended (delivered or broken off); the lease runs again from now. True when an
        end held back by the pulls now applies: the caller frees the pin."""
        if self.status != TransferStatus.PULLING:
            return False
        self.num_pulls -= 1
        self.expires_at = now + self.lease_s
        if self.num_pulls > 0:
            return False
        self.status = TransferStatus.PUBLISHED
        return self.ending is not None and self._end(self.ending)

    def renew(self, now: float) -> bool:
        """The destination still wants the blocks: the lease runs `lease_s` from now."""
        if self.status.is_ended or self.ending is not None:
            return False
        self.expires_at = now + self.lease_s
        return True

    def complete(self) -> bool:
        """The destination has the KV (or gave up on it): release the pin (after any pull in
        progress)."""
        return self._end(TransferStatus.COMPLETED)

    def revoke(self) -> bool:
        """The source aborted the request: release the pin (after any pull in progress); later
        pulls fail."""
        return self._end(TransferStatus.REVOKED)

    def expire(self, now: float) -> bool:
        """The lease lapsed without a pull in progress: release the pin."""
        if self.status != TransferStatus.PUBLISHED or now < self.expires_at:
            return False
        return self._end(TransferStatus.EXPIRED)

    def _end(self, status: TransferStatus) -> bool:
        if self.status.is_ended or (
            self.ending is not None and self.status == TransferStatus.PULLING
        ):
            return False
        if self.status == TransferStatus.PULLING:
            self.ending = status  # the blocks are being read: end when the last pull does
            return False
        self.status = status
        self.num_pulls = 0
        return True


class LeaseTable:
    """Every lease of one source, thread-safe (RPC threads renew and pull; the engine thread
    publishes, completes and expires). `clock` returns seconds (monotonic)."""

    def __init__(
        self, lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not lease_s > 0:
            raise ValueError(f"kv_lease_seconds: must be > 0, got {lease_s!r}")
        self.lease_s = lease_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}  # not ended
        self._ended: OrderedDict[str, tuple[float, Lease]] = (
            OrderedDict()
        )  # request_id -> (ended at, lease)
        self._early: dict[
            str, float
        ] = {}  # request_id -> when a completion came before its publish
        self._lock = threading.Lock()

    def publish(self, request_id: str) -> bool:
        """Start a lease for a newly pinned request. False (and the caller must release the pin
        at once) when a completion for it already came: its client cancelled while it ran."""
        with self._lock:
            now = self.clock()
            lease = Lease(request_id, self.lease_s, now + self.lease_s)
            if self._early.pop(request_id, None) is not None:
                lease.complete()
                self._remember(lease, now)
                return False
            self._leases[request_id] = lease
            return True

    def begin_pull(self, request_id: str) -> None:
        """Raises RequestNotFoundError for an unknown or ended transfer."""
        with self._lock:
            self._get(request_id).begin_pull(self.clock())

    def end_pull(self, request_id: str) -> bool:
        """True when the transfer ended with this pull (an end came meanwhile): the caller frees
        the pin."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or not lease.end_pull(self.clock()):
                return False
            del self._leases[request_id]
            self._remember(lease, self.clock())
            return True

    def renew(self, request_id: str) -> bool:
        """False for an unknown or ended transfer (the destination should give up on it)."""
        with self._lock:
            lease = self._leases.get(request_id)
            return lease is not None and lease.renew(self.clock())

    def complete(self, request_id: str) -> bool:
        """True when this call ended the transfer (the caller releases the pin); during a pull
        the end waits for `end_pull`. A completion for a request not published yet is
        remembered and applied at its publish."""
        return self._end(request_id, Lease.complete, remember_early=True)

    def revoke(self, request_id: str) -> bool:
        return self._end(request_id, Lease.revoke, remember_early=False)

    def expire_due(self) -> list[str]:
        """End every lapsed lease; returns their request ids (the caller releases the pins)."""
        with self._lock:
            now = self.clock()
            expired = [lease for lease in self._leases.values() if lease.expire(now)]
            for lease in expired:
                del self._leases[lease.request_id]
                self._remember(lease, now)
            self._forget_old(now)
            return [lease.request_id for lease in expired]

    def status(self, request_id: str) -> TransferStatus | None:
        """The transfer's status; None if never published (or ended long ago)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None and request_id in self._ended:
                lease = self._ended[request_id][1]
            return None if lease is None else lease.status

    def __len__(self) -> int:
        """Leases not ended (pinned requests)."""
        return len(self._leases)

    def _get(self, request_id: str) -> Lease:
        lease = self._leases.get(request_id)
        if lease is None:
            ended = self._ended.get(request_id)
            why = f"was {ended[1].status.value}" if ended else "was never published here"
            raise RequestNotFoundError(f"KV of request {request_id!r} {why}")
        return lease

    def _end(
        self, request_id: str, transition: Callable[[Lease], bool], remember_early: bool
    ) -> bool:
        with self._lock:
            now = self.clock()
            lease = self._leases.get(request_id)
            if lease is None:
                if remember_early and request_id not in self._ended:
                    self._early[request_id] = now
                return False
            ended = transition(lease)
            if ended:
                del self._leases[request_id]
                self._remember(lease, now)
            return ended

    def _remember(self, lease: Lease, now: float) -> None:
        self._ended[lease.request_id] = (now, lease)
        self._ended.move_to_end(lease.request_id)
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)

    def _forget_old(self, now: float) -> None:
        while self._ended and now - next(iter(self._ended.values()))[0] > ENDED_TTL_S:
            self._ended.popitem(last=False)
        if self._early:
            self._early = {rid: t for rid, t in self._early.items() if now - t < ENDED_TTL_S}
