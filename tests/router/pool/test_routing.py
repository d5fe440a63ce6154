"""Worker picks (services/router/pool/routing.py): round robin, least loaded, and KV-aware routing
with the in-process prefix index (no Redis)."""

from __future__ import annotations

import pytest

from services.common.errors import ServiceUnavailableError
from services.router.pool.routing import Routing
from services.router.pool.worker_pool import WorkerPool


def test_round_robin_picks_skip_unhealthy_workers_and_empty_pools():
    pool = WorkerPool(["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3"])
    routing = Routing(pool, "round_robin")
    picks = [routing.pick_prefill([5, 6])[0] for _ in range(5)]
    assert picks == ["127.0.0.1:1", "127.0.0.1:2"] * 2 + ["127.0.0.1:1"]
    assert [routing.pick_decode() for _ in range(2)] == ["127.0.0.1:3"] * 2
    pool.unhealthy.add("127.0.0.1:2")
    assert {routing.pick_prefill([5])[0] for _ in range(3)} == {"127.0.0.1:1"}
    pool.unhealthy.add("127.0.0.1:1")  # all out: fail open, the calls themselves will say why
    assert {routing.pick_prefill([5])[0] for _ in range(4)} == {"127.0.0.1:1", "127.0.0.1:2"}
    assert pool.channel("127.0.0.1:1") is pool.channel("127.0.0.1:1")
    pool.close()
    empty = Routing(WorkerPool([], []), "round_robin")
    with pytest.raises(ServiceUnavailableError):
        empty.pick_prefill([5])
    with pytest.raises(ServiceUnavailableError):
        empty.pick_decode()
    with pytest.raises(ValueError, match="^decode:"):
        WorkerPool(["127.0.0.1:1"], ["nohost"])
    with pytest.raises(ValueError, match="^routing:"):
        Routing(WorkerPool([], []), "random")


def test_least_loaded_counts_queued_prompt_tokens_and_decode_streams():
    pool = WorkerPool(["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3", "127.0.0.1:4"])
    routing = Routing(pool, "least_loaded")
    first, _ = routing.pick_prefill(list(range(100)))
    second, _ = routing.pick_prefill(list(range(10)))
    third, _ = routing.pick_prefill(list(range(10)))
    assert second != first and third == second  # 10 + 10 queued there is still less than 100
    routing.prefill_done(first, 100)
    assert routing.pick_prefill([1])[0] == first
    a, b = routing.pick_decode(), routing.pick_decode()
    assert {a, b} == {"127.0.0.1:3", "127.0.0.1:4"}
    routing.decode_done(a)
    assert routing.pick_decode() == a
    pool.close()


def test_kv_routing_without_redis_learns_where_it_sent_each_prefix():
    """The approximate in-process index: after a prompt went to a worker, prompts sharing its
    full blocks go there too; other prompts spread by load; the guesses per worker are capped."""
    pool = WorkerPool(["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3"])
    pool.prefill_layout = lambda: ("model@0", 16)
    pool.prefill_num_blocks = lambda: 4
    routing = Routing(pool, "kv")

    def route(prompt: list[int]) -> tuple[str, int]:
        address, expected = routing.pick_prefill(prompt)
        routing.prefill_done(address, len(prompt))
        routing.learn_routed(address, prompt)
        return address, expected

    shared = list(range(2, 50))  # 3 full blocks
    first, expected = route(shared + [7])
    assert expected == 0
    for suffix in ([8], [9, 10], [11] * 20):
        assert route(shared + suffix) == (first, 48)
    # New prompts, cached nowhere: equal cost, so consecutive ones alternate.
    assert route(list(range(100, 140)))[0] != route(list(range(300, 340)))[0]
    # 4 blocks at most per worker: a long new prompt on `first` pushes the shared prefix out.
    routing.learn_routed(first, list(range(200, 280)))
    assert route(shared + [12])[1] == 0
    # A decode worker keeps the prompts it streamed: the path choice asks what it holds, and
    # prefill routing never sends a prompt to it.
    decode = pool.decode[0]
    assert routing.peek(shared + [13])[2:] == (decode, 0)
    routing.learn_routed(decode, shared + [13])
    prefill, prefill_cached, _, decode_cached = routing.peek(shared + [14])
    assert decode_cached == 48 and (prefill, prefill_cached) == route(shared + [14])
    assert route(shared + [15])[0] in pool.prefill
    assert Routing(pool, "least_loaded").peek(shared)[3] == 0
    pool.close()
