"""Worker side of the prefix index: publish the engine's prefix-cache events, and heartbeat.

The engine thread only moves events into a queue (an EngineLoop idle hook, after every step);
a publisher thread sends them, so a slow or dead Redis never stalls the engine. The publisher
sends a full snapshot of the cache's hashes in place of the events it may have missed: at
start-up (clearing what a previous process left under the same address), after any failed call,
and when a heartbeat finds its entries gone (Redis restarted or flushed between two calls).
"""

from __future__ import annotations

import logging
import queue
import threading

from services.engine.kv_events import KVEvent
from services.prefix_index.index import PrefixIndex, PrefixIndexUnavailable
from services.worker.engine_loop import EngineLoop

logger = logging.getLogger(__name__)


class KVEventPublisher:
    """Sends one worker's events to `index` under `worker` (its gRPC address), heartbeating at
    least every `heartbeat_s` seconds and retrying every `heartbeat_s` while the index is down."""

    def __init__(
        self, loop: EngineLoop, index: PrefixIndex, worker: str, heartbeat_s: float
    ) -> None:
        self.loop = loop
        self.index = index
        self.worker = worker
        self.heartbeat_s = heartbeat_s
        self._events: queue.Queue[list[KVEvent]] = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        loop.add_idle_hook(self._collect)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._events.put([])  # wakes the thread at once
        self._thread.join(timeout=5)
        self.index.close()

    def _collect(self) -> None:
        """Engine thread: hand this step's events to the publisher."""
        events = self.loop.engine.take_kv_events()
        if events:
            self._events.put(events)

    def _snapshot(self) -> list:
        """Engine thread: the cache's hashes now, with every event up to now dropped (the
        snapshot covers them; later events queue up behind it)."""
        self.loop.engine.take_kv_events()
        while not self._events.empty():
            self._events.get_nowait()
        return self.loop.engine.prefix_cache_hashes()

    def _run(self) -> None:
        in_sync, outage = False, False
        while not self._stopped.is_set():
            try:
                if not in_sync:
                    self.index.replace(self.worker, self.loop.call(self._snapshot))
                    in_sync = True
                    if outage:
                        logger.warning(
                            "prefix index reachable again: %s sent a snapshot", self.worker
                        )
                    outage = False
                try:
                    batch = self._events.get(timeout=self.heartbeat_s)
                except queue.Empty:
                    in_sync = self.index.heartbeat(self.worker)
                    continue
                while not self._events.empty():
                    batch += self._events.get_nowait()
                self.index.apply(self.worker, batch)
            except PrefixIndexUnavailable as exc:
                if not outage:
                    logger.warning(
                        "prefix index unavailable (%s); "
                        "routing falls back to load until it returns",
                        exc,
                    )
                in_sync, outage = False, True
                self._stopped.wait(self.heartbeat_s)
            except Exception:  # noqa: BLE001 - the engine stopped, or a bug: log, keep the worker up
                logger.exception("publishing prefix-cache events failed")
                in_sync = False
                self._stopped.wait(self.heartbeat_s)


def publish_prefix_cache(
    loop: EngineLoop, address: str, redis_url: str | None, ttl_s: float
) -> KVEventPublisher | None:
    """With a Redis index (`redis_url`): start publishing the engine's prefix-cache events under
    the worker's `address`, heartbeating every `ttl_s` / 3 seconds; the caller stops it. None
    without one."""
    from services.prefix_index.index import make_prefix_index

    if not redis_url:
        return None
    engine = loop.engine
    index = make_prefix_index(redis_url, engine.model_id, engine.config.block_size, ttl_s)
    publisher = KVEventPublisher(loop, index, address, heartbeat_s=ttl_s / 3)
    publisher.start()
    return publisher
