"""Routing policies: which prefill and which decode worker serve a request (`--routing`).

- `kv` (default): a prefill worker's cost is the prompt tokens it would have to compute (those
  past its longest cached prefix, from the prefix index) plus the prompt tokens already queued
  on it by this router; the cheapest wins (Dynamo's KV router cost, overlap vs load; SGLang's
  cache-aware policy in spirit). Decode: fewest requests in flight, then most free KV blocks.
- `least_loaded`: fewest queued prompt tokens (prefill) / requests in flight (decode).
- `round_robin`: the next healthy worker in turn.

With `--redis-url` the index is exact: workers publish their cache events to Redis. Without it the
router keeps an approximate in-process index of where it sent each prompt's blocks, on prefill
and decode workers alike (it cannot see evictions, so it can only expect hits that then miss).
Decode workers' entries serve the serving-path choice (`serving_path.py`), not prefill routing.
When the index is unreachable the `kv` policy routes by load alone. The worker's own cache
always decides what is reused, so no policy can change an answer.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Sequence

from services.engine.block_hash import ROOT_HASH, block_hashes, max_cached_blocks
from services.engine.kv_events import BlockStored
from services.prefix_index.index import (
    InMemoryPrefixIndex,
    PrefixIndex,
    PrefixIndexUnavailable,
    make_prefix_index,
)
from services.router.pool.worker_pool import WorkerPool

logger = logging.getLogger(__name__)
POLICIES = ("kv", "least_loaded", "round_robin")


class Routing:
    """Picks workers for one request and keeps the router's per-worker load counts.

    `index` (kv policy): where cached prefixes are; `learn=True` records each routed prompt in it
    (the approximate in-process mode, without `redis_url`). Thread-safe.
    """

    def __init__(
        self,
        pool: WorkerPool,
        policy: str = "kv",
        redis_url: str | None = None,
        index_ttl_s: float = 10.0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing: expected one of {list(POLICIES)}, got {policy!r}")
        if not index_ttl_s > 0:
            raise ValueError(f"index_ttl: must be > 0 seconds, got {index_ttl_s!r}")
        self.pool = pool
        self.policy = policy
        self.redis_url = redis_url
        self.index_ttl_s = index_ttl_s
        self.index: PrefixIndex | None = (
            None  # made once the workers' model id and block size are known
        )
        self.learn = redis_url is None
        self._lock = threading.Lock()
        # Per worker, whenever it joined the pool: prompt tokens in flight (prefill), streams
        # (decode).
        self.queued_tokens: defaultdict[str, int] = defaultdict(int)
        self.in_flight: defaultdict[str, int] = defaultdict(int)
        self.decode_context: defaultdict[str, int] = defaultdict(int)  # their context tokens
        self.local_queued: defaultdict[str, int] = defaultdict(int)  # local prefills' tokens
        self._index_down = False
        self._turns = {"prefill": 0, "decode": 0}

    def _rotated(self, candidates: list[str], role: str) -> list[str]:
        """`candidates` starting one further on at each call: its first entry is round-robin,
        and `min` over it breaks ties round-robin."""
        with self._lock:
            shift = self._turns[role] % len(candidates)
            self._turns[role] += 1
        return candidates[shift:] + candidates[:shift]

    # -- prefill -------------------------------------------------------------------------------

    def pick_prefill(
        self, prompt_ids: Sequence[int], cache_salt: str = "", prefer: str | None = None
    ) -> tuple[str, int]:
        """(address, expected cached prompt tokens) for a prompt; the caller must call
        `prefill_done(address, len(prompt_ids))` when its Prefill call ends. `prefer`: this
        worker while it is healthy (a sibling sequence's, whose cache holds the prompt).
        Raises ServiceUnavailableError when no prefill worker is configured."""
        candidates = self._rotated(self.pool.healthy_prefill(), "prefill")
        if prefer in candidates:
            candidates = [prefer]
        address, expected = self._best_prefill(candidates, prompt_ids, cache_salt)
        with self._lock:
            self.queued_tokens[address] += len(prompt_ids)
        return address, expected

    def peek(self, prompt_ids: Sequence[int], cache_salt: str = "") -> tuple[str, int, str, int]:
        """What `pick_prefill` and `pick_decode` would answer now, without taking either
        worker: (prefill address, the prompt tokens it holds cached, decode address, the prompt
        tokens it holds cached), from one prefix-index lookup (cached counts are 0 under a
        policy other than kv). Raises ServiceUnavailableError when a pool has no worker
        configured."""
        candidates = self.pool.healthy_prefill()
        decode = self.peek_decode()
        matched = (
            self._matched_tokens([*candidates, decode], prompt_ids, cache_salt)
            if self.policy == "kv"
            else {}
        )
        prefill, cached = self._best_prefill(candidates, prompt_ids, cache_salt, matched)
        return prefill, cached, decode, matched.get(decode, 0)

    def _best_prefill(
        self,
        candidates: list[str],
        prompt_ids: Sequence[int],
        cache_salt: str,
        matched: dict[str, int] | None = None,
    ) -> tuple[str, int]:
        """The cheapest of `candidates` and its cached prompt tokens; `matched`: the index's
        answer when the caller has it (else it is asked here)."""
        if self.policy == "round_robin":
            return candidates[0], 0
        if matched is None:
            matched = (
                self._matched_tokens(candidates, prompt_ids, cache_salt)
                if self.policy == "kv"
                else {}
            )
        with self._lock:
            address = min(
                candidates,
                key=lambda a: (
                    len(prompt_ids) - matched.get(a, 0) + self.queued_tokens[a],
                    self.queued_tokens[a],
                ),
            )
        return address, matched.get(address, 0)

    def prefill_done(self, address: str, num_prompt_tokens: int) -> None:
        with self._lock:
            self.queued_tokens[address] -= num_prompt_tokens

    def _matched_tokens(
        self, candidates: list[str], prompt_ids: Sequence[int], salt: str
    ) -> dict[str, int]:
        """Prompt tokens each candidate holds cached, by the index; {} without hashing info or
        when the index is unreachable (then routing goes by load)."""
        layout = self.pool.prefill_layout()
        if layout is None:
            return {}
        model_id, block_size = layout
        if self.index is None:
            if self.learn:  # guesses: no heartbeats, no evictions heard; keep a cache's worth each
                self.index = InMemoryPrefixIndex(
                    float("inf"), max_blocks_per_worker=self.pool.prefill_num_blocks()
                )
            else:
                self.index = make_prefix_index(
                    self.redis_url, model_id, block_size, self.index_ttl_s
                )
        num_blocks = max_cached_blocks(len(prompt_ids), block_size)  # the engine's own rule
        hashes = block_hashes(
            prompt_ids[: num_blocks * block_size], block_size, model_id, salt or None
        )
        try:
            matched = self.index.match(hashes)
            if self._index_down:
                logger.warning("prefix index reachable again")
            self._index_down = False
        except PrefixIndexUnavailable as exc:
            if not self._index_down:
                logger.warning("prefix index unavailable (%s): routing by load", exc)
            self._index_down = True
            return {}
        return {a: matched.get(a, 0) * block_size for a in candidates}

    def learn_routed(self, address: str, prompt_ids: Sequence[int], cache_salt: str = "") -> None:
        """Approximate mode: the worker at `address` (prefill, or decode: it keeps the prompts
        it streams) is about to cache this prompt's full blocks."""
        layout = self.pool.prefill_layout()
        if not self.learn or layout is None or self.index is None:
            return
        model_id, block_size = layout
        hashes = block_hashes(prompt_ids, block_size, model_id, cache_salt or None)
        if hashes:
            self.index.apply(address, [BlockStored(tuple(hashes), ROOT_HASH, (), block_size)])

    # -- decode --------------------------------------------------------------------------------

    def pick_decode(self, prefer: str | None = None, context_tokens: int = 0) -> str:
        """A decode worker (`prefer` while it is healthy) for a stream of `context_tokens`
        (prompt and tokens resumed); the caller must call `decode_done(address,
        context_tokens)` when its stream ends."""
        candidates = self._rotated(self.pool.healthy_decode(), "decode")
        if prefer in candidates:
            candidates = [prefer]
        address = self._best_decode(candidates)
        with self._lock:
            self.in_flight[address] += 1
            self.decode_context[address] += context_tokens
        return address

    def peek_decode(self) -> str:
        """What `pick_decode` would answer now (round robin: the next in turn), without taking
        the worker. Raises ServiceUnavailableError when no decode worker is configured."""
        candidates = self.pool.healthy_decode()
        if self.policy == "round_robin":
            with self._lock:
                return candidates[self._turns["decode"] % len(candidates)]
        return self._best_decode(candidates)

    def _best_decode(self, candidates: list[str]) -> str:
        if self.policy == "round_robin":
            return candidates[0]
        free = self.pool.decode_free_blocks()
        with self._lock:
            return min(candidates, key=lambda a: (self.in_flight[a], -free.get(a, 0)))

    def decode_done(self, address: str, context_tokens: int = 0) -> None:
        with self._lock:
            self.in_flight[address] -= 1
            self.decode_context[address] -= context_tokens

    def local_prefill(self, address: str, tokens: int) -> None:
        """`tokens` prompt tokens start (> 0) or end (< 0) prefilling on decode worker
        `address` (the local path; `serving_path.PathLoad.local_queued`)."""
        with self._lock:
            self.local_queued[address] += tokens
