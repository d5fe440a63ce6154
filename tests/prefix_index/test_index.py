"""The prefix index, both backends behind one interface, against a real Redis server."""

from __future__ import annotations

import time
import uuid

import pytest

from services.engine.block_hash import ROOT_HASH, block_hashes
from services.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.prefix_index.index import (
    InMemoryPrefixIndex,
    PrefixIndexUnavailable,
    RedisPrefixIndex,
    make_prefix_index,
)

HASHES = block_hashes(list(range(64)), 16, "model@0")  # 4 blocks


@pytest.fixture(params=["memory", "redis"])
def index(request, redis_server):
    if request.param == "memory":
        yield InMemoryPrefixIndex(ttl_s=1.0)
        return
    index = RedisPrefixIndex(redis_server.url, f"test:{uuid.uuid4().hex}", ttl_s=1.0)
    yield index
    index.close()


def _stored(hashes) -> BlockStored:
    return BlockStored(tuple(hashes), ROOT_HASH, tuple(range(16 * len(hashes))), 16)


def test_match_counts_leading_blocks_per_worker(index):
    index.apply("a:1", [_stored(HASHES)])
    index.apply("b:2", [_stored(HASHES[:2])])
    index.apply("c:3", [_stored(HASHES[1:])])  # lacks the first block: holds no prefix of it
    assert index.match(HASHES) == {"a:1": 4, "b:2": 2, "c:3": 0}
    index.apply(
        "a:1", [BlockRemoved((HASHES[1],))]
    )  # a middle block evicted: the match stops there
    assert index.match(HASHES)["a:1"] == 1
    index.apply("b:2", [AllBlocksCleared()])
    assert index.match(HASHES) == {"a:1": 1, "b:2": 0, "c:3": 0}
    assert index.match([]) == {"a:1": 0, "b:2": 0, "c:3": 0}


def test_a_worker_that_stops_heartbeating_drops_out(index):
    index.apply("a:1", [_stored(HASHES)])
    index.apply("b:2", [_stored(HASHES)])
    for _ in range(3):
        time.sleep(0.5)
        index.heartbeat("b:2")
    assert index.match(HASHES) == {"b:2": 4}


def test_redis_down_raises_unavailable_and_the_index_recovers(redis_server):
    if not redis_server.owned:
        pytest.skip("needs a redis-server binary to stop and restart")
    index = make_prefix_index(redis_server.url, "model@0", 16, ttl_s=5.0)
    index.apply("a:1", [_stored(HASHES)])
    redis_server.stop()
    try:
        with pytest.raises(PrefixIndexUnavailable):
            index.match(HASHES)
        with pytest.raises(PrefixIndexUnavailable):
            index.apply("a:1", [_stored(HASHES)])
    finally:
        redis_server.start()
    # The restarted server kept nothing; workers' next events fill it again.
    assert index.match(HASHES) == {}
    index.apply("a:1", [_stored(HASHES[:3])])
    assert index.match(HASHES) == {"a:1": 3}
    index.close()


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_a_worker_publishes_its_cache_and_resyncs_after_redis_restarts(tiny_llama, redis_server):
    """The publisher keeps the index equal to the engine's cache: events while Redis is up, a
    snapshot once it is back (a restarted Redis holds nothing)."""
    if not redis_server.owned:
        pytest.skip("needs a redis-server binary to stop and restart")
    from services.engine import EngineRole, SamplingParams
    from services.prefix_index.publisher import KVEventPublisher
    from services.worker.engine_loop import EngineLoop
    from tests.engine.helpers import GREEDY, make_engine

    engine = make_engine(tiny_llama, role=EngineRole.BOTH, num_blocks=64, enable_kv_events=True)
    loop = EngineLoop(engine, "prefill")
    index = make_prefix_index(redis_server.url, engine.model_id, 16, ttl_s=3.0)
    publisher = KVEventPublisher(loop, index, "127.0.0.1:1", heartbeat_s=0.2)
    loop.start()
    publisher.start()
    try:

        def run(prompt, request_id):
            stream = loop.submit(request_id, prompt, SamplingParams(max_tokens=1, **GREEDY))
            while not stream.get(timeout=30).finished:
                pass

        first = list(range(2, 2 + 3 * 16 + 1))
        run(first, "a")
        hashes = block_hashes(first, 16, engine.model_id)
        assert _wait_for(lambda: index.match(hashes) == {"127.0.0.1:1": 3})
        redis_server.stop()
        second = list(range(100, 100 + 2 * 16 + 1))
        run(second, "b")  # its events are lost with Redis down
        redis_server.start()
        both = hashes + block_hashes(second, 16, engine.model_id)
        assert _wait_for(lambda: _safe_match(index, hashes + []) == {"127.0.0.1:1": 3})
        assert _wait_for(
            lambda: (
                _safe_match(index, block_hashes(second, 16, engine.model_id)) == {"127.0.0.1:1": 2}
            )
        )
        # Emptied between two calls (a quick restart, FLUSHALL): the next heartbeat notices.
        import redis

        redis.Redis.from_url(redis_server.url).flushall()
        assert _wait_for(lambda: _safe_match(index, hashes) == {"127.0.0.1:1": 3})
        loop.call(engine.reset_prefix_cache)
        assert _wait_for(lambda: _safe_match(index, both) == {"127.0.0.1:1": 0})
    finally:
        publisher.stop()
        loop.stop()


def _safe_match(index, hashes):
    try:
        return index.match(hashes)
    except PrefixIndexUnavailable:
        return None


def test_a_gone_cluster_leaves_no_redis_key(redis_server):
    """Every key expires a ttl after the last heartbeat, the live-workers set included."""
    namespace = f"test:{uuid.uuid4().hex}"
    index = RedisPrefixIndex(redis_server.url, namespace, ttl_s=1.0)
    try:
        index.apply("a:1", [_stored(HASHES)])
        keys = [f"{namespace}:workers", index._worker_key("a:1")]
        assert all(0 < index.client.ttl(key) <= 1 for key in keys)
        time.sleep(2.1)
        assert index.client.exists(*keys) == 0
    finally:
        index.close()
