"""The router's view of its workers: addresses, cached channels, health, and what GetInfo says.

Membership is the `--prefill` / `--decode` addresses plus the workers that register at run time
(`add` / `remove`, driven by `services/router/pool/registration.py`). `start_health_checks()`
runs a thread that asks every worker's standard gRPC health service (`grpc.health.v1.Health`,
service "") every `interval_s` seconds: a worker that fails HEALTH_FAILURES checks in a row (no
SERVING answer within `timeout_s`: dead, hung, or draining after SIGTERM) gets no new requests
until it answers again. If every worker of a role is out, requests go to all of them anyway
(fail open: the call itself then says what is wrong). The same thread reads each decode worker's
free KV blocks and every worker's view (`serving_path.WorkerView`: threads, fitted step costs;
GetInfo) for routing and the serving path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import grpc

from services.common import metrics
from services.common.channels import ChannelCache, check_address, health_serving
from services.common.errors import ServiceUnavailableError
from services.common.pb import common_pb2, worker_pb2_grpc
from services.router.pool.path_prediction import WorkerView

CAPACITY_TIMEOUT_S = 5.0
CAPACITY_RETRY_S = 10.0
HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 1.0
HEALTH_FAILURES = 2  # failed checks in a row before a worker is out (one slow answer is not)
logger = logging.getLogger(__name__)


class WorkerPool:
    """Prefill and decode worker addresses (HOST:PORT) with one cached gRPC channel each.

    `healthy_prefill()` / `healthy_decode()` list the workers to route to (ServiceUnavailableError
    when none is configured); `services.router.pool.routing` picks among them. Channels (and stubs)
    are created on first use and shared by every request: gRPC multiplexes concurrent calls over
    one connection. Thread-safe.
    """

    def __init__(
        self, prefill: Iterable[str], decode: Iterable[str], dynamic: bool = False
    ) -> None:
        # Replaced, never mutated (`add` / `remove`): a reader's list stays consistent.
        self.prefill = [check_address(a, "prefill") for a in prefill]
        self.decode = [check_address(a, "decode") for a in decode]
        self._configured = frozenset([*self.prefill, *self.decode])  # never removed
        self._dynamic = dynamic
        if not self.decode and not dynamic:
            logger.warning("no decode workers: every request gets UNAVAILABLE")
        if not self.prefill and not dynamic:  # fine when every prompt is prefilled locally
            logger.warning(
                "no prefill workers: a request sent to the prefill pool gets UNAVAILABLE"
            )
        self._lock = threading.Lock()
        self._channels = ChannelCache()
        self._capacity: dict[str, int] = {}  # address -> tokens of KV one request can hold there
        self._capacity_retry_at: dict[str, float] = {}  # address -> when to ask again
        self.unhealthy: set[str] = set()  # addresses taken out of routing
        self._marked_at: dict[str, float] = {}  # address -> when a call found it down
        self._failures: dict[str, int] = {}  # address -> consecutive failed health checks
        self._free_blocks: dict[str, int] = {}  # decode address -> free KV blocks at the last check
        self._views: dict[str, WorkerView] = {}  # address -> its last GetInfo, for routing
        self._view_asked: dict[str, float] = {}  # prefill address -> when GetInfo was last tried
        self._layout: tuple[str, int] | None = None  # (model_id, block_size) of the prefill workers
        self._prefill_num_blocks: int | None = None
        self._stop = threading.Event()
        self._health_thread: threading.Thread | None = None

    # -- membership ----------------------------------------------------------------------------

    def add(self, role: str, address: str) -> None:
        """`address` joins the `role` pool ("prefill" | "decode") and gets requests at once (a
        worker registers once it serves); no-op when it is there already."""
        check_address(address, role)
        with self._lock:
            if address in getattr(self, role):
                return
            setattr(self, role, [*getattr(self, role), address])
        logger.info("%s worker %s joined the pool", role, address)

    def remove(self, role: str, address: str) -> None:
        """`address` leaves the `role` pool: no new requests, its channel closed (calls still
        on it fail with CANCELLED: it left cleanly or its lease lapsed). A configured address
        (`--prefill` / `--decode`) stays."""
        with self._lock:
            if address not in getattr(self, role) or address in self._configured:
                return
            setattr(self, role, [a for a in getattr(self, role) if a != address])
            for table in (
                self._marked_at,
                self._capacity,
                self._capacity_retry_at,
                self._failures,
                self._free_blocks,
                self._views,
                self._view_asked,
            ):
                table.pop(address, None)
            self.unhealthy.discard(address)
        self._channels.drop(address)
        metrics.forget_worker(address)
        logger.info("%s worker %s left the pool", role, address)

    # -- health --------------------------------------------------------------------------------

    def start_health_checks(
        self, interval_s: float = HEALTH_INTERVAL_S, timeout_s: float = HEALTH_TIMEOUT_S
    ) -> None:
        """Check every worker now, then every `interval_s` seconds on a daemon thread."""
        self._check_all(timeout_s)
        self._health_thread = threading.Thread(
            target=self._health_loop,
            args=(interval_s, timeout_s),
            name="router-health",
            daemon=True,
        )
        self._health_thread.start()

    def _health_loop(self, interval_s: float, timeout_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._check_all(timeout_s)

    def _check_all(self, timeout_s: float) -> None:
        for address in self.addresses:
            started = time.monotonic()
            healthy = self._serving(address, timeout_s)
            if healthy and self._wants_info(address, started):
                self._read_info(address, timeout_s)
            with self._lock:
                if address not in self.prefill and address not in self.decode:
                    continue  # it left the pool during the check
                self._failures[address] = 0 if healthy else self._failures.get(address, 0) + 1
                healthy = healthy or (
                    self._failures[address] < HEALTH_FAILURES and address not in self.unhealthy
                )
                # A check that began before a call found the worker down says nothing new.
                healthy = healthy and started > self._marked_at.get(address, 0.0)
                if healthy and address in self.unhealthy:
                    logger.info("worker %s is healthy again", address)
                    self.unhealthy.discard(address)
                elif not healthy and address not in self.unhealthy:
                    logger.warning("worker %s is unhealthy: no new requests go there", address)
                    self.unhealthy.add(address)
            metrics.WORKER_HEALTHY.labels("router", address).set(1 if healthy else 0)

    def _wants_info(self, address: str, now: float) -> bool:
        """A decode worker's free blocks at every check; a prefill worker's view until it has
        fitted costs, asked every CAPACITY_RETRY_S (its GetInfo waits for a running prefill)."""
        if address in self.decode:
            return True
        view = self._views.get(address)
        if view is not None and view.costs:
            return False
        return now - self._view_asked.get(address, -CAPACITY_RETRY_S) >= CAPACITY_RETRY_S

    def _read_info(self, address: str, timeout_s: float) -> None:
        """GetInfo for routing only (health is the health service's answer)."""
        self._view_asked[address] = time.monotonic()
        stub = self.decode_stub(address) if address in self.decode else self.prefill_stub(address)
        try:
            info = stub.GetInfo(common_pb2.InfoRequest(), timeout=timeout_s)
        except grpc.RpcError:
            self._free_blocks.pop(address, None)
            return
        if address in self.decode:
            self._free_blocks[address] = info.num_free_blocks
        self._views[address] = WorkerView.from_info(info.config_json, info.step_costs_json)

    def view(self, address: str) -> WorkerView | None:
        """What the last GetInfo of `address` said (None before one answered)."""
        return self._views.get(address)

    def _serving(self, address: str, timeout_s: float) -> bool:
        return health_serving(self.channel(address), timeout_s)

    def mark_unhealthy(self, address: str) -> None:
        """A call found the worker down: skip it until its next health check passes."""
        metrics.WORKER_HEALTHY.labels("router", address).set(0)
        with self._lock:
            new = address not in self.unhealthy
            self.unhealthy.add(address)
            self._marked_at[address] = time.monotonic()
        if new:
            logger.warning("worker %s is unhealthy (a call found it down)", address)

    def is_unhealthy(self, address: str) -> bool:
        return address in self.unhealthy

    def wait_healthy(self, role: str, timeout: float) -> bool:
        """Waits up to `timeout` seconds until a `role` worker is in routing (a restarted or
        newly joined one included); True when one is."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if any(a not in self.unhealthy for a in getattr(self, role)):
                    return True
            if time.monotonic() >= deadline or self._stop.wait(0.05):
                return False

    @property
    def addresses(self) -> list[str]:
        """Every worker, prefill then decode, each once."""
        return list(dict.fromkeys([*self.prefill, *self.decode]))

    def healthy_prefill(self) -> list[str]:
        """Prefill workers in routing (all of them when every one is out: fail open);
        ServiceUnavailableError when none is configured."""
        return self._healthy(self.prefill, "prefill")

    def healthy_decode(self) -> list[str]:
        return self._healthy(self.decode, "decode")

    def _healthy(self, addresses: list[str], role: str) -> list[str]:
        if not addresses:
            how = "registered" if self._dynamic else "configured"
            raise ServiceUnavailableError(f"no {role} workers {how}")
        with self._lock:
            healthy = [a for a in addresses if a not in self.unhealthy]
        return healthy or list(addresses)  # fail open: the call will say what is wrong

    def decode_free_blocks(self) -> dict[str, int]:
        return dict(self._free_blocks)

    def decode_slots(self, healthy_only: bool = True) -> int:
        """Sequences the (healthy) decode workers run at once: the sum of their max_num_seqs (a
        worker whose GetInfo has not answered yet counts with the engine's default)."""
        with self._lock:
            workers = [a for a in self.decode if not healthy_only or a not in self.unhealthy]
        return sum(self._views.get(a, WorkerView()).max_num_seqs for a in workers)

    def prefill_layout(self) -> tuple[str, int] | None:
        """(model_id, block_size) the prefill workers hash blocks with (GetInfo, asked once);
        None while no prefill worker answers."""
        if self._layout is None:
            for address in self.prefill:
                try:
                    info = self.prefill_stub(address).GetInfo(
                        common_pb2.InfoRequest(), timeout=CAPACITY_TIMEOUT_S
                    )
                except grpc.RpcError:
                    continue
                self._layout = (info.model_id, info.kv_layout.block_size)
                self._prefill_num_blocks = info.num_blocks
                break
        return self._layout

    def prefill_num_blocks(self) -> int | None:
        """KV blocks of a prefill worker (GetInfo, with `prefill_layout`)."""
        self.prefill_layout()
        return self._prefill_num_blocks

    def channel(self, address: str) -> grpc.Channel:
        """The cached insecure channel to `address` (created on first use; any HOST:PORT)."""
        return self._channels.get(address)

    def prefill_stub(self, address: str) -> worker_pb2_grpc.PrefillStub:
        return worker_pb2_grpc.PrefillStub(self.channel(address))

    def decode_stub(self, address: str) -> worker_pb2_grpc.DecodeStub:
        return worker_pb2_grpc.DecodeStub(self.channel(address))

    def kv_transfer_stub(self, address: str) -> worker_pb2_grpc.KVTransferStub:
        return worker_pb2_grpc.KVTransferStub(self.channel(address))

    def decode_capacity(self) -> int | None:
        """Most tokens (prompt + output) one request can hold in any decode worker's KV cache:
        num_blocks * block_size from each worker's GetInfo, asked once and cached. None when no
        worker answers (the request then goes ahead; the worker itself refuses what never fits)."""
        capacities = [c for c in (self._worker_capacity(a) for a in self.decode) if c is not None]
        return max(capacities) if capacities else None

    def _worker_capacity(self, address: str) -> int | None:
        if address in self._capacity:
            return self._capacity[address]
        if time.monotonic() < self._capacity_retry_at.get(address, 0.0):
            return None
        try:
            info = self.decode_stub(address).GetInfo(
                common_pb2.InfoRequest(), timeout=CAPACITY_TIMEOUT_S
            )
        except grpc.RpcError:  # down, or not a pdserve worker: ask again a little later
            self._capacity_retry_at[address] = time.monotonic() + CAPACITY_RETRY_S
            return None
        self._capacity[address] = info.num_blocks * info.kv_layout.block_size
        return self._capacity[address]

    def close(self) -> None:
        """Stops health checks and closes every cached channel (in-flight calls on them fail
        with CANCELLED)."""
        self._stop.set()
        self._channels.close()
