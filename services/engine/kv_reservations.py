"""DECODE role: KV blocks reserved before a request's prompt KV moves.

Mooncake's and vLLM's P/D rule: the KV never arrives to a full cache. A request whose prompt KV
comes from a transfer reserves blocks for its whole prompt and first token when it arrives,
hitting its own prefix cache for every full prompt block it can (those are not pulled). One that
finds no room waits in a bounded FIFO queue (`max_num_waiting_for_kv`; one more is refused with
ResourceExhaustedError), and one whose KV has not loaded `kv_transfer_timeout_s` after it came
times out. A reserved request joins the running batch through `Scheduler.schedule(ready_remote)`
once its KV can be loaded.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from services.engine.config import EngineConfig
from services.engine.errors import ResourceExhaustedError
from services.engine.kv_cache import KVCache
from services.engine.request import Request
from services.engine.scheduler import Scheduler


class KVReservations:
    """The queued and reserved DECODE requests of one engine (engine thread only).

    `clock` returns seconds (monotonic); tests drive deadlines with a fake one.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache: KVCache,
        scheduler: Scheduler,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.scheduler = scheduler  # counts the prefix-cache hits of each reservation
        self.clock = clock
        self.waiting_for_kv: deque[Request] = deque()  # no blocks yet (FIFO, bounded)
        self.reserved: list[Request] = []  # blocks reserved, prompt KV not loaded yet
        self.newly_reserved: list[Request] = []  # reserved since `take_new` last ran

    def add(self, request: Request) -> None:
        """Reserve blocks for a new request now if no earlier one is queued for blocks, else
        queue it. Raises ResourceExhaustedError when `max_num_waiting_for_kv` requests already
        wait."""
        request.kv_deadline = self.clock() + self.config.kv_transfer_timeout_s
        if not self.waiting_for_kv and self._reserve(request):
            return
        if len(self.waiting_for_kv) >= self.config.max_num_waiting_for_kv:
            raise ResourceExhaustedError(
                f"KV cache full: {len(self.waiting_for_kv)} requests already wait for blocks "
                f"(max_num_waiting_for_kv); retry later or on another decode worker"
            )
        self.waiting_for_kv.append(request)

    def reserve_waiting(self) -> None:
        """Reserve blocks for queued requests, first come first served."""
        while self.waiting_for_kv and self._reserve(self.waiting_for_kv[0]):
            self.waiting_for_kv.popleft()

    def _reserve(self, request: Request) -> bool:
        """Blocks for the whole prompt (filled by the transfer, or by the local prefix cache)
        and the first token; False (nothing taken) when the cache is short."""
        block_size = self.kv_cache.spec.block_size
        num_prompt = request.remote_handle.num_tokens
        cached = self.kv_cache.get_computed_blocks(request, num_prompt // block_size)
        num_cached = len(cached) * block_size
        if not self.kv_cache.allocate_slots(request, request.num_tokens - num_cached, cached):
            return False
        request.kv_first_block = len(cached)
        self.scheduler.record_prefix_hit(request, num_prompt, num_cached)
        self.reserved.append(request)
        self.newly_reserved.append(request)
        return True

    def take_new(self) -> list[Request]:
        """The requests reserved since the last call (after reserving for queued ones)."""
        self.reserve_waiting()
        new, self.newly_reserved = self.newly_reserved, []
        return new

    def timed_out(self) -> list[Request]:
        """Requests whose KV did not arrive by their deadline (queued or reserved)."""
        now = self.clock()
        return [r for r in (*self.waiting_for_kv, *self.reserved) if now >= r.kv_deadline]

    def started(self, requests: list[Request]) -> None:
        """These reserved requests joined the running batch."""
        for request in requests:
            self.reserved.remove(request)

    def remove(self, request: Request) -> None:
        """Forget a request that ended before it ran (its blocks are the caller's to free)."""
        for queue in (self.reserved, self.waiting_for_kv, self.newly_reserved):
            if request in queue:
                queue.remove(request)

    def __len__(self) -> int:
        """Requests queued for blocks or reserved and waiting for their KV."""
        return len(self.waiting_for_kv) + len(self.reserved)
