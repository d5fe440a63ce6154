"""Which worker holds which cached prefix: the router's prefix index.

Keys are block hashes (`services.engine.block_hash`), namespaced by model id and block size.
Workers apply their engine's prefix-cache events (`kv_events`) under their own id (the gRPC
address the router knows them by) and heartbeat; a worker that stops heartbeating for `ttl_s`
seconds drops out of every answer, and its entries expire. The router asks, in one call, how many
leading blocks of a prompt each worker holds (llm-d's KV-cache index and Dynamo's KV router
keep the same per-worker view, fed by the same three event kinds).

Two backends behind `PrefixIndex`: `InMemoryPrefixIndex` (one process; the default) and
`RedisPrefixIndex` (redis-py; shared by every worker and router of a cluster). A stale entry can
only make the router expect a hit that the worker then misses: the worker's own cache decides
what is reused, so the index can never cause a wrong answer.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

from services.engine.block_hash import BlockHash
from services.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

DEFAULT_TTL_S = 10.0


class PrefixIndex(ABC):
    """Per-worker sets of cached block hashes. Implementations are thread-safe.

    Errors: `RedisPrefixIndex` raises `PrefixIndexUnavailable` when Redis cannot be reached;
    callers fall back to routing by load.
    """

    @abstractmethod
    def apply(self, worker: str, events: Sequence[KVEvent]) -> None:
        """Apply a worker's events, in order, and count as its heartbeat."""

    @abstractmethod
    def replace(self, worker: str, block_hashes: Sequence[BlockHash]) -> None:
        """The worker holds exactly these hashes now (a snapshot after a restart or an outage);
        counts as its heartbeat."""

    @abstractmethod
    def heartbeat(self, worker: str) -> bool:
        """The worker is alive (keeps its entries from expiring). False when the index lost
        them (a restarted or flushed Redis): the worker should send a snapshot."""

    @abstractmethod
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For every live worker: how many of `block_hashes`, from the first on, it holds
        (counting stops at the first one it lacks)."""

    def close(self) -> None:  # noqa: B027 - a deliberate no-op default, not abstract
        """Release connections (no-op by default)."""


class PrefixIndexUnavailable(RuntimeError):
    """The index's store cannot be reached (Redis down or restarting)."""


class InMemoryPrefixIndex(PrefixIndex):
    """The index in this process's memory (tests; one-process deployments)."""

    def __init__(
        self, ttl_s: float = DEFAULT_TTL_S, max_blocks_per_worker: int | None = None
    ) -> None:
        """`max_blocks_per_worker`: keep only this many most recently stored hashes per worker
        (for an index fed by guesses, which never hears of evictions)."""
        self.ttl_s = ttl_s
        self.max_blocks_per_worker = max_blocks_per_worker
        self._blocks: dict[str, dict[BlockHash, None]] = {}  # insertion order = least recent first
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def apply(self, worker: str, events: Sequence[KVEvent]) -> None:
        with self._lock:
            held = self._blocks.setdefault(worker, {})
            for event in events:
                if isinstance(event, BlockStored):
                    for block_hash in event.block_hashes:
                        held.pop(block_hash, None)
                        held[block_hash] = None
                elif isinstance(event, BlockRemoved):
                    for block_hash in event.block_hashes:
                        held.pop(block_hash, None)
                elif isinstance(event, AllBlocksCleared):
                    held.clear()
            while self.max_blocks_per_worker is not None and len(held) > self.max_blocks_per_worker:
                del held[next(iter(held))]
            self._seen[worker] = time.monotonic()

    def replace(self, worker: str, block_hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self._blocks[worker] = dict.fromkeys(block_hashes)
            self._seen[worker] = time.monotonic()

    def heartbeat(self, worker: str) -> bool:
        with self._lock:
            self._seen[worker] = time.monotonic()
            return worker in self._blocks

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        now = time.monotonic()
        with self._lock:
            for worker in [w for w, seen in self._seen.items() if now - seen > self.ttl_s]:
                del self._seen[worker]  # expired, as a Redis key would
                self._blocks.pop(worker, None)
            return {
                worker: _leading(self._blocks.get(worker, {}), block_hashes)
                for worker in self._seen
            }


def _leading(held: dict[BlockHash, None], block_hashes: Sequence[BlockHash]) -> int:
    count = 0
    for block_hash in block_hashes:
        if block_hash not in held:
            break
        count += 1
    return count


# Liveness uses the Redis server's clock (TIME), so hosts' clocks need not agree.
# KEYS[1]: the live-workers sorted set, KEYS[2]: the worker's set. ARGV: worker, ttl.
# Returns 1 if the worker's set exists (its entries survived), else 0. The sorted set expires
# too, a ttl after the last heartbeat of any worker: a cluster that is gone leaves no key.
_TOUCH_SCRIPT = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1e6, ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return redis.call('EXPIRE', KEYS[2], ARGV[2])
"""

# KEYS[1]: the live-workers sorted set. ARGV: ttl, worker-key prefix, hashes (hex)...
# Returns [worker, count, worker, count, ...] for every worker seen within ttl.
_MATCH_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]))
local workers = redis.call('ZRANGE', KEYS[1], 0, -1)
local out = {}
for _, worker in ipairs(workers) do
  local key = ARGV[2] .. worker
  local count = 0
  for i = 3, #ARGV do
    if redis.call('SISMEMBER', key, ARGV[i]) == 0 then break end
    count = count + 1
  end
  table.insert(out, worker)
  table.insert(out, count)
end
return out
"""


class RedisPrefixIndex(PrefixIndex):
    """The index in Redis: one set of hex hashes per worker (`{ns}:worker:{id}`, expiring
    `ttl_s` after the worker's last heartbeat) and a sorted set of workers by last heartbeat
    (`{ns}:workers`). `match` is one server-side script call: one round trip per request.
    `namespace` should name the model and block size ("pdserve:{model_id}:{block_size}").
    """

    def __init__(
        self, url: str, namespace: str, ttl_s: float = DEFAULT_TTL_S, timeout_s: float = 0.5
    ) -> None:
        import redis

        self._redis_errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.namespace = namespace
        self.ttl_s = ttl_s
        self._match = self.client.register_script(_MATCH_SCRIPT)
        self._touch_script = self.client.register_script(_TOUCH_SCRIPT)

    def _worker_key(self, worker: str) -> str:
        return f"{self.namespace}:worker:{worker}"

    def _run(self, fn):
        try:
            return fn()
        except self._redis_errors as exc:
            raise PrefixIndexUnavailable(f"redis: {exc}") from exc

    def apply(self, worker: str, events: Sequence[KVEvent]) -> None:
        key = self._worker_key(worker)

        def write() -> None:
            pipe = self.client.pipeline(transaction=True)
            for event in events:
                if isinstance(event, BlockStored):
                    pipe.sadd(key, *(h.hex() for h in event.block_hashes))
                elif isinstance(event, BlockRemoved):
                    pipe.srem(key, *(h.hex() for h in event.block_hashes))
                elif isinstance(event, AllBlocksCleared):
                    pipe.delete(key)
            self._touch(pipe, worker)
            pipe.execute()

        self._run(write)

    def _touch(self, pipe, worker: str) -> None:
        self._touch_script(
            keys=[f"{self.namespace}:workers", self._worker_key(worker)],
            args=[worker, max(1, int(self.ttl_s + 0.999))],
            client=pipe,
        )

    def replace(self, worker: str, block_hashes: Sequence[BlockHash]) -> None:
        key = self._worker_key(worker)

        def write() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(key)
            hexes = [h.hex() for h in block_hashes]
            for start in range(0, len(hexes), 1000):
                pipe.sadd(key, *hexes[start : start + 1000])
            self._touch(pipe, worker)
            pipe.execute()

        self._run(write)

    def heartbeat(self, worker: str) -> bool:
        def beat() -> bool:
            pipe = self.client.pipeline(transaction=True)
            self._touch(pipe, worker)
            return bool(pipe.execute()[-1])

        return self._run(beat)

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        reply = self._run(
            lambda: self._match(
                keys=[f"{self.namespace}:workers"],
                args=[self.ttl_s, f"{self.namespace}:worker:", *(h.hex() for h in block_hashes)],
            )
        )
        return {reply[i].decode(): int(reply[i + 1]) for i in range(0, len(reply), 2)}

    def close(self) -> None:
        self.client.close()


def make_prefix_index(
    redis_url: str | None, model_id: str, block_size: int, ttl_s: float = DEFAULT_TTL_S
) -> PrefixIndex:
    """`RedisPrefixIndex` when `redis_url` is given, else `InMemoryPrefixIndex`.
    ValueError naming `index_ttl` unless `ttl_s` > 0."""
    if not ttl_s > 0:
        raise ValueError(f"index_ttl: must be > 0 seconds, got {ttl_s!r}")
    if redis_url:
        return RedisPrefixIndex(redis_url, f"pdserve:{model_id}:{block_size}", ttl_s)
    return InMemoryPrefixIndex(ttl_s)
